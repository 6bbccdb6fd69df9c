"""The router-facing routes (server/serving_info.py) answer from the live engine.

In-process over the tiny engine: /model_info and /server_info carry the engine's own numbers
(window, KV blocks, block size, batch limits), /get_load counts a request while it runs and
drops back to zero after; the render routes give exactly the ids the completion routes prefill
(the trace's prompt ids), refuse what those refuse, and generate nothing; /flush_cache drops the
prefix cache, so the same prompt again finds nothing cached; the routes need the key when one is
set. One subprocess test checks that `onecall serve` answers them under the names the routers probe.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from onecall.sampling_params import SamplingParams
from onecall.server.app import ServerConfig, create_app
from onecall.server.async_engine import AsyncEngine
from tests.helpers.server_process import ServerProcess
from tests.helpers.tiny_engine import tiny_engine

KEY = "sk-info"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _in_process(test: Any, engine: AsyncEngine, config: ServerConfig | None = None) -> None:
    async def main() -> None:
        app = create_app(engine, config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://onecall") as client:
                await asyncio.wait_for(test(client, engine), timeout=60)

    asyncio.run(main())


def test_model_and_server_info_are_the_engines_own_numbers() -> None:
    engine = AsyncEngine(tiny_engine(num_blocks=96, block_size=4, max_num_seqs=7), max_waiting=11)

    async def test(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        e = ae.engine
        for path in ("/model_info", "/get_model_info"):
            info = (await client.get(path)).json()
            assert info["max_context_length"] == e.max_model_len
            assert info["served_model_name"] == "tiny" and info["model_path"] == e.parts.model_name
            assert info["vocab_size"] == e.model_config.vocab_size and info["is_generation"] is True
            assert info["eos_token_ids"] == sorted(e.tokenizer.eos_token_ids)
        for path in ("/server_info", "/get_server_info"):
            info = (await client.get(path)).json()
            assert info["num_kv_blocks"] == 96 and info["page_size"] == 4
            assert info["max_total_num_tokens"] == 96 * 4
            assert info["max_running_requests"] == 7 and info["max_queued_requests"] == 11
            assert info["context_length"] == e.max_model_len and info["disable_radix_cache"] is False
            (s,) = info["internal_states"]
            assert s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 and s["num_used_tokens"] == 0
            assert s["num_free_blocks"] + s["num_cached_blocks"] == 96

    _in_process(test, engine, ServerConfig(served_model_name="tiny"))


def test_load_counts_a_running_request_then_returns_to_zero() -> None:
    engine = AsyncEngine(tiny_engine(num_blocks=256, block_size=4))

    async def test(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        stream = await ae.add_request("r1", "Hello there, how are you?", params)
        await stream.__anext__()  # its first token: it runs now, 399 steps to go
        load = (await client.get("/get_load")).json()
        assert load["load"] == 1 and load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["num_tokens"] > 0 and load["num_tokens"] % 4 == 0  # whole blocks
        (state,) = (await client.get("/server_info")).json()["internal_states"]
        assert state["num_running_reqs"] == 1 and 0 < state["kv_cache_usage"] <= 1
        async for out in stream:
            if out.finished:
                break
        for _ in range(100):  # the engine thread publishes the finish before it frees the blocks
            load = (await client.get("/get_load")).json()
            if load["load"] == 0 and load["num_tokens"] == 0:
                break
            await asyncio.sleep(0.01)
        assert load == {"load": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        (state,) = (await client.get("/server_info")).json()["internal_states"]
        assert state["num_cached_blocks"] > 0  # the finished prompt stayed in the prefix cache
        assert state["prefix_cache_hit_rate"] == 0.0

    _in_process(test, engine)


def test_info_routes_need_the_key() -> None:
    engine = AsyncEngine(tiny_engine())

    async def test(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        for path in ("/model_info", "/get_server_info", "/get_load"):
            assert (await client.get(path)).status_code == 401
            assert (await client.get(path, headers=AUTH)).status_code == 200
        render = {"prompt": "Hi"}
        for path, body in (("/v1/completions/render", render), ("/flush_cache", None)):
            assert (await client.post(path, json=body)).status_code == 401
            assert (await client.post(path, json=body, headers=AUTH)).status_code == 200

    _in_process(test, engine, ServerConfig(api_key=KEY))


MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_render_gives_the_ids_the_completion_prefills_and_generates_nothing() -> None:
    engine = AsyncEngine(tiny_engine(num_blocks=256, block_size=4))

    async def test(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        # 1. chat: the render's ids are the trace's prompt ids of the same body's completion
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0.0}
        r = await client.post("/v1/chat/completions/render", json=chat)
        assert r.status_code == 200, r.text
        rendered = r.json()
        assert rendered["model"] == "tiny" and rendered["features"] is None and rendered["request_id"]
        assert ae.engine.stats.num_prefix_cache_query_tokens_total == 0  # nothing reached the engine
        done = (await client.post("/v1/chat/completions", json={**chat, "trace": True})).json()
        assert rendered["token_ids"] == done["trace"]["prompt_token_ids"]
        assert len(rendered["token_ids"]) == done["usage"]["prompt_tokens"]
        # 2. completions: text gets the BOS the completion adds; ids pass as they are; one entry each
        text = "The capital of France is"
        r = await client.post("/v1/completions/render", json={"prompt": [text, "Hello"]})
        assert r.status_code == 200, r.text
        first, second = r.json()
        r = await client.post("/v1/completions/render", json={"prompt": [5, 6, 7]})
        assert [x["token_ids"] for x in r.json()] == [[5, 6, 7]]
        done = (
            await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "trace": True})
        ).json()
        assert first["token_ids"] == done["trace"]["prompt_token_ids"]
        assert second["token_ids"] == ae.engine.tokenizer.encode("Hello", add_special_tokens=True)
        assert first["request_id"] != second["request_id"]
        # 3. what the completions refuse, the renders refuse the same way
        r = await client.post("/v1/completions/render", json={"prompt": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await client.post("/v1/chat/completions/render", json={**chat, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.post("/v1/chat/completions/render", json={"messages": "not a list"})
        assert r.status_code == 400

    _in_process(test, engine, ServerConfig(served_model_name="tiny"))


def test_flush_cache_drops_the_prefix_cache() -> None:
    engine = AsyncEngine(tiny_engine(num_blocks=256, block_size=4))
    body = {"prompt": "One two three four five six seven eight nine ten", "max_tokens": 1}

    async def cached(client: httpx.AsyncClient) -> int:
        usage = (await client.post("/v1/completions", json=body)).json()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    async def test(client: httpx.AsyncClient, ae: AsyncEngine) -> None:
        assert await cached(client) == 0
        assert await cached(client) > 0  # the same prompt again: its prefix is cached
        (state,) = (await client.get("/server_info")).json()["internal_states"]
        assert state["num_cached_blocks"] > 0
        r = await client.post("/flush_cache")
        assert r.status_code == 200 and r.json()["flushed"] is True
        (state,) = (await client.get("/server_info")).json()["internal_states"]
        assert state["num_cached_blocks"] == 0 and state["num_free_blocks"] == 256
        assert await cached(client) == 0  # nothing left to match
        ae.engine.block_manager.check_invariants()

    _in_process(test, engine)


@pytest.mark.server
def test_onecall_serve_answers_what_the_routers_probe() -> None:
    proc = ServerProcess("--max-model-len", "256", "--max-num-seqs", "5").start()
    try:
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/get_load"):
            r = httpx.get(proc.url(path), timeout=10)
            assert r.status_code == 200, (path, r.text)
        # what vllm-router sends before it routes a request, and its /flush_cache fan-out
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": False}
        for path, body in (
            ("/v1/chat/completions/render", chat),
            ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 4}),
            ("/flush_cache", None),
        ):
            r = httpx.post(proc.url(path), json=body, timeout=30)
            assert r.status_code == 200, (path, r.text)
        info = httpx.get(proc.url("/get_model_info"), timeout=10).json()
        assert info["max_context_length"] == 256 and info["model_path"] == info["served_model_name"]
        server = httpx.get(proc.url("/get_server_info"), timeout=10).json()
        assert server["max_running_requests"] == 5 and server["max_total_num_tokens"] > 0
    finally:
        assert proc.stop() == 0
