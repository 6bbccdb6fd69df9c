"""KV-cache events for vllm-router's kv_aware policy (engine/radix_cache.py's listener, server/kv_events.py).

1. The radix cache tells its listener each change of the cached paths: an insert names the path and
   where its new positions start, an eviction the evicted leaf's path and start, a reset "cleared";
   a split says nothing. No ZMQ needed.
2. The publisher turns them into vLLM-shaped batches on a real PUB socket: whole blocks only, ids
   chained by prefix (the same blocks removed carry the ids they were stored under), salted paths
   left out, AllBlocksCleared on reset. Needs pyzmq and msgpack (the fleet extra); skipped without.
3. End to end in process: a completion's prompt arrives as BlockStored blocks of its own token ids,
   and /flush_cache as AllBlocksCleared.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from onecall.engine.block_manager import BlockManager
from tests.helpers.server_process import free_port


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def stored(self, path: list[int], start: int, salt: str | None) -> None:
        self.calls.append(("stored", tuple(path), start, salt))

    def removed(self, path: list[int], start: int, salt: str | None) -> None:
        self.calls.append(("removed", tuple(path), start, salt))

    def cleared(self) -> None:
        self.calls.append(("cleared",))


def _cache(mgr: BlockManager, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
    """One sequence through the manager: match, grow, (copies), commit its tokens, release."""
    assert mgr.begin(seq_id, tokens, salt) is not None
    assert mgr.ensure_capacity(seq_id, len(tokens))
    mgr.take_copy_ops()
    mgr.commit(seq_id, tokens)
    mgr.free(seq_id)


def test_the_radix_cache_tells_its_listener_what_it_caches_and_drops() -> None:
    mgr = BlockManager(num_blocks=32, block_size=4)
    rec = Recorder()
    mgr.tree.listener = rec
    a = list(range(10))
    b = a[:6] + [100, 101, 102, 103, 104, 105]
    _cache(mgr, 1, a)
    _cache(mgr, 2, b)  # splits a's edge at 6, then adds [6, 12) of b
    _cache(mgr, 3, a[:8])  # ends inside a cached edge: nothing new
    _cache(mgr, 4, [7, 7, 7, 7, 7], salt="tenant")
    assert rec.calls == [
        ("stored", tuple(a), 0, None),
        ("stored", tuple(b), 6, None),
        ("stored", (7, 7, 7, 7, 7), 0, "tenant"),
    ]
    rec.calls.clear()
    mgr.tree.evict(target_free=32)  # everything: the leaves first, then the shared [0, 6)
    assert sorted(rec.calls) == sorted(
        [
            ("removed", tuple(a), 6, None),
            ("removed", tuple(b), 6, None),
            ("removed", tuple(a[:6]), 0, None),
            ("removed", (7, 7, 7, 7, 7), 0, "tenant"),
        ]
    )
    assert rec.calls.index(("removed", tuple(a[:6]), 0, None)) > rec.calls.index(
        ("removed", tuple(a), 6, None)
    )
    _cache(mgr, 5, a)
    rec.calls.clear()
    mgr.reset_prefix_cache()
    assert rec.calls == [("cleared",)]
    mgr.check_invariants()


class Subscriber:
    """A SUB socket on the publisher's endpoint, decoding its batches."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    def events(self, until: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Events of every batch received until one of type `until` arrives."""
        import msgpack

        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket.poll(100):
                topic, seq, payload = self.socket.recv_multipart()
                ts, events, rank = msgpack.unpackb(payload)
                assert topic == b"" and len(seq) == 8 and isinstance(ts, float) and rank is None
                got.extend(events)
                if any(e["type"] == until for e in events):
                    return got
        raise TimeoutError(f"no {until} event within {timeout} s; got {got}")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def _connected(publisher: Any, sub: Subscriber) -> None:
    """PUB drops what it sends before a subscriber's connection is up: send probes until one arrives."""
    for _ in range(100):
        publisher.cleared()
        try:
            sub.events(until="AllBlocksCleared", timeout=0.1)
        except TimeoutError:
            continue
        while sub.socket.poll(300):  # a probe that arrived late must not pass for the test's events
            sub.socket.recv_multipart()
        return
    raise TimeoutError("the subscriber never connected")


def test_the_publisher_sends_whole_blocks_with_chained_ids() -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    from onecall.server.kv_events import KVEventPublisher, block_ids

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint, block_size=4)
    sub = Subscriber(endpoint)
    try:
        _connected(pub, sub)
        path = list(range(50, 61))  # 11 tokens: blocks 0 and 1 whole, the last 3 tokens not a block
        pub.stored(path[:6], 0, None)  # block 0 only
        pub.stored(path, 6, None)  # completes block 1 (positions 4..7); 8..10 stay partial
        pub.stored(path, 0, "tenant")  # salted: nothing
        pub.removed(path, 5, None)  # breaks block 1 (it held position 5); block 0 stays
        pub.removed([1, 2], 0, None)  # no whole block: nothing
        pub.cleared()
        first, second, removed, cleared = sub.events(until="AllBlocksCleared")
        ids = block_ids(path, 2, 4)
        assert first == {
            "type": "BlockStored",
            "block_hashes": [ids[0]],
            "parent_block_hash": None,
            "token_ids": path[:4],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        assert second["block_hashes"] == [ids[1]] and second["parent_block_hash"] == ids[0]
        assert second["token_ids"] == path[4:8]
        assert removed == {"type": "BlockRemoved", "block_hashes": [ids[1]], "medium": "GPU"}
        assert cleared == {"type": "AllBlocksCleared"}
        assert block_ids([9, *path[1:]], 2, 4)[1] != ids[1]  # a block's id depends on its whole prefix
        assert all(0 <= i < 2**63 for i in ids)
    finally:
        sub.close()
        pub.close()


def test_a_served_prompt_arrives_as_its_own_blocks_and_flush_as_cleared() -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    from onecall.server.app import create_app
    from onecall.server.async_engine import AsyncEngine
    from onecall.server.kv_events import KVEventPublisher
    from tests.helpers.tiny_engine import tiny_engine

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint, block_size=4)
    sub = Subscriber(endpoint)
    engine = tiny_engine(num_blocks=128, block_size=8)  # the pool's blocks need not be the events'
    engine.block_manager.tree.listener = pub
    prompt = "One two three four five six seven eight nine ten eleven twelve"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=True)

    async def main() -> list[dict[str, Any]]:
        app = create_app(AsyncEngine(engine))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert (await client.post("/flush_cache")).status_code == 200
        return await asyncio.to_thread(sub.events, "AllBlocksCleared")

    try:
        _connected(pub, sub)
        events = asyncio.run(main())
        stored = [e for e in events if e["type"] == "BlockStored"]
        tokens = [t for e in stored for t in e["token_ids"]]
        assert len(tokens) >= (len(ids) // 4) * 4 and tokens[: len(ids) // 4 * 4] == ids[: len(ids) // 4 * 4]
        assert events[-1] == {"type": "AllBlocksCleared"}
    finally:
        sub.close()
        pub.close()


def test_the_publisher_binds_loopback_only_unless_allowed_and_publishes_one_namespace() -> None:
    """The events carry prompts' token ids to whoever connects: beyond loopback is refused unless
    allowed; and only the namespace unsalted requests share is published (the shared tenants' one
    under --shared-prefix-cache), never another salt's paths."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    from onecall.server.kv_events import KVEventPublisher, is_loopback_endpoint
    from onecall.server.tenants import SHARED_CACHE_SALT

    local = ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:5557", "tcp://[::1]:5557", "tcp://localhost:5557",
             "tcp://127.0.0.1:*", "ipc:///tmp/onecall-kv", "inproc://kv"]  # fmt: skip
    remote = ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557", "tcp://192.168.1.5:5557",
              "tcp://eth0:5557", "tcp://kv.example.com:5557", "ws://127.0.0.1:5557", "127.0.0.1:5557"]  # fmt: skip
    assert all(is_loopback_endpoint(e) for e in local)
    assert not any(is_loopback_endpoint(e) for e in remote)
    with pytest.raises(ValueError, match="beyond loopback"):
        KVEventPublisher(f"tcp://0.0.0.0:{free_port()}")

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(endpoint, block_size=4, salt=SHARED_CACHE_SALT)
    sub = Subscriber(endpoint)
    try:
        _connected(pub, sub)
        pub.stored([1, 2, 3, 4], 0, None)  # nothing lands here in that mode; not published either
        pub.stored([5, 6, 7, 8], 0, "tenant:abc")  # a private namespace
        pub.stored([9, 10, 11, 12], 0, SHARED_CACHE_SALT)
        pub.cleared()
        stored, cleared = sub.events(until="AllBlocksCleared")
        assert stored["token_ids"] == [9, 10, 11, 12] and cleared == {"type": "AllBlocksCleared"}
    finally:
        sub.close()
        pub.close()
