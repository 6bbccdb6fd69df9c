"""The router-facing introspection routes (server/serving_info.py) answer from the live engine.

In-process over the tiny engine: /model_info and /server_info carry the engine's own numbers
(window, KV blocks, block size, batch limits), /get_load counts a request while it runs and
drops back to zero after; the routes need the key when one is set. One subprocess test checks
that `onecall serve` answers them under the names SGLang's router probes.
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

    _in_process(test, engine, ServerConfig(api_key=KEY))


@pytest.mark.server
def test_onecall_serve_answers_what_sglang_router_probes() -> None:
    proc = ServerProcess("--max-model-len", "256", "--max-num-seqs", "5").start()
    try:
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info", "/get_load"):
            r = httpx.get(proc.url(path), timeout=10)
            assert r.status_code == 200, (path, r.text)
        info = httpx.get(proc.url("/get_model_info"), timeout=10).json()
        assert info["max_context_length"] == 256 and info["model_path"] == info["served_model_name"]
        server = httpx.get(proc.url("/get_server_info"), timeout=10).json()
        assert server["max_running_requests"] == 5 and server["max_total_num_tokens"] > 0
    finally:
        assert proc.stop() == 0
