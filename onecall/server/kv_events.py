"""KV-cache events for vllm-router's `kv_aware` policy: the radix cache's inserts and evictions,
published as vLLM publishes its own (BlockStored / BlockRemoved / AllBlocksCleared on a ZMQ PUB socket).

    onecall serve --port 8001 --kv-events-endpoint tcp://127.0.0.1:5557
    python -m vllm_router.launch_router --policy kv_aware --worker-urls http://127.0.0.1:8001 ... \\
        --kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:5557 --kv-event-block-size 16 \\
        --kv-event-model MODEL

The router keeps, per worker, a radix index of the blocks it was told about, keyed by the token ids
each event carries; it tokenizes a request through the worker's /v1/chat/completions/render and
credits each worker with the run of leading blocks it holds. So what matters on the wire is the token
ids of whole blocks, in order, and an id per block that BlockRemoved can name again.

onecall's tree is token-granular (radix_cache.py); the events speak of *logical* blocks of `block_size`
tokens along a cached path, aligned at position 0 and independent of the KV pool's own block size:

    | tree change                                  | event                                         |
    |----------------------------------------------|-----------------------------------------------|
    | positions [s, n) of path P inserted          | BlockStored for blocks s//B .. n//B - 1       |
    | positions [s, n) of path P evicted           | BlockRemoved for the same blocks              |
    | reset (/flush_cache)                         | AllBlocksCleared                              |
    | a path under another cache_salt              | nothing (the router cannot tell salts apart)  |

The published namespace is the one requests without a salt of their own share: the unsalted one,
or with tenants in one shared cache the salt they share (`salt`, tenants.published_cache_salt).
Tenants in private namespaces (the default with several keys) are never published.

Block i of P is cached exactly when positions [0, (i+1)B) of P are: an insert at s completes the
blocks ending in (s, n], and an eviction of a leaf [s, n) (nothing below it) breaks the same ones.
A partial last block is never announced. Block i's id chains blake2b over P[:(i+1)B] (64 bits, the top
bit clear: vLLM's ExternalBlockHash is an int), so the same prefix always has the same id.

Threads: the listener runs on the engine thread and only appends to a list under a lock; a daemon
thread sends what has gathered every `interval` seconds as one batch, `[topic, seq (8 bytes, big
endian), msgpack([ts, [event, ...], None])]`, each event a map tagged by "type" with vLLM's field names.
pyzmq and msgpack come with the `fleet` extra; nothing imports this module unless the flag is given.

Who can read it: every event carries the token ids of a cached prompt, i.e. the prompts themselves
(detokenized with the model's tokenizer), and a ZMQ PUB socket has no authentication. So the
publisher binds loopback (tcp://127.0.0.1, [::1], localhost) or local transports (ipc://, whose
socket file's permissions decide, and inproc://) unless it is told `allow_remote`
(serve --kv-events-allow-remote, which logs a warning): `*`, 0.0.0.0, an interface, a hostname or
another address would hand every prompt to whoever reaches the port.
"""

from __future__ import annotations

import hashlib
import ipaddress
import struct
import threading
import time
from array import array
from typing import Any

import msgpack
import zmq

_TOP_BIT_CLEAR = (1 << 63) - 1


def block_ids(path: list[int], num_blocks: int, block_size: int) -> list[int]:
    """The ids of the first num_blocks whole blocks of path: each hashes its parent's id and its tokens."""
    ids: list[int] = []
    parent = b""
    for i in range(num_blocks):
        tokens = array("q", path[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=8).digest()
        ids.append(int.from_bytes(parent, "big") & _TOP_BIT_CLEAR)
    return ids


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether binding a ZMQ endpoint stays on this machine: ipc:// and inproc://, or tcp:// on a
    loopback address or `localhost`. `*`, 0.0.0.0, ::, interface names, hostnames: False."""
    transport, sep, address = endpoint.partition("://")
    if not sep:
        return False
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False  # pgm, epgm, udp, ws, ...: network transports
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def changed_blocks(path: list[int], start: int, block_size: int) -> range:
    """Blocks whose cached state flips when positions [start, len(path)) of path do (table above)."""
    return range(start // block_size, len(path) // block_size)


class KVEventPublisher:
    """A radix_cache.CacheListener that publishes vLLM-shaped KV events over ZMQ (see the module doc)."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int = 16,
        topic: str = "",
        interval: float = 0.02,
        salt: str | None = None,
        allow_remote: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"kv events block_size must be >= 1, got {block_size}")
        if not allow_remote and not is_loopback_endpoint(endpoint):
            raise ValueError(
                f"{endpoint!r} binds beyond loopback; KV events carry every cached prompt's token ids "
                "to anyone who connects (allow_remote=True to bind it anyway)"
            )
        self.endpoint = endpoint
        self.block_size = block_size
        self.salt = salt  # the namespace published (the module doc)
        self.topic = topic.encode()
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []  # guarded by _lock
        self._seq = 0
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.bind(endpoint)  # a busy port or a bad address fails here, before serving
        self._thread = threading.Thread(target=self._run, name="onecall-kv-events", daemon=True)
        self._thread.start()

    # ---- CacheListener (the engine thread) ---------------------------------------------------------
    def stored(self, path: list[int], start: int, salt: str | None) -> None:
        blocks = changed_blocks(path, start, self.block_size)
        if salt != self.salt or not blocks:
            return
        ids = block_ids(path, blocks.stop, self.block_size)
        bs = self.block_size
        self._add(
            {
                "type": "BlockStored",
                "block_hashes": ids[blocks.start :],
                "parent_block_hash": ids[blocks.start - 1] if blocks.start else None,
                "token_ids": path[blocks.start * bs : blocks.stop * bs],
                "block_size": bs,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )

    def removed(self, path: list[int], start: int, salt: str | None) -> None:
        blocks = changed_blocks(path, start, self.block_size)
        if salt != self.salt or not blocks:
            return
        ids = block_ids(path, blocks.stop, self.block_size)
        self._add({"type": "BlockRemoved", "block_hashes": ids[blocks.start :], "medium": "GPU"})

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(event)

    # ---- the publishing thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        """Send what has gathered as one batch (from the publishing thread, or close())."""
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return
        payload = msgpack.packb([time.time(), events, None])
        self._socket.send_multipart([self.topic, struct.pack(">Q", self._seq), payload])
        self._seq += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.flush()
        self._socket.close(linger=0)
        self._context.term()
