"""The routes a router calls besides the completions themselves (bodies: protocol_info.py).

    GET  /model_info, /get_model_info     the model's identity and limits
    GET  /server_info, /get_server_info   settings plus the engine's live state
    GET  /get_load                        running + waiting requests and KV tokens held
    POST /v1/chat/completions/render      a chat body -> the token ids its completion would prefill
    POST /v1/completions/render           a completion body -> the same, one entry per prompt
    POST /flush_cache                     drop the prefix cache (the router fans it out to every replica)

Cache-aware routers (vllm-router and sgl-router, `--policy cache_aware`) register a worker by
its model and server info and poll its load; these answer with SGLang's field names (load: the
shape vllm-router reads) from the live engine. vllm-router renders each request on a worker before
it routes (vLLM's render routes: the prompt as token ids, nothing generated) and matches those ids
against what it sent each worker; the render goes through the completion routes' own steps
(serving_chat.prepare_chat: the same template, tools and validation), so the ids are the ones the
completion prefills and a body the completion would refuse is refused here with the same 400.

Reads happen on the event loop while the engine thread steps. Each value is one int read (atomic
under the GIL); a response may mix values from two adjacent steps (running from one, waiting from
the next), which is fine for load balancing and never inconsistent within one field.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from onecall import __version__
from onecall.engine.engine import Engine
from onecall.server.params import completion_prompts
from onecall.server.protocol import ChatCompletionRequest, CompletionRequest
from onecall.server.protocol_info import (
    FlushCacheResponse,
    InternalState,
    LoadResponse,
    ModelInfoResponse,
    RenderList,
    RenderResponse,
    ServerInfoResponse,
)
from onecall.server.serving_chat import prepare_chat
from onecall.server.state import ServerState
from onecall.text.tokenizer import Tokenizer


async def get_model_info(state: ServerState, request: Request, request_id: str) -> Response:
    return _json(model_info(state))


async def get_server_info(state: ServerState, request: Request, request_id: str) -> Response:
    return _json(server_info(state))


async def get_load(state: ServerState, request: Request, request_id: str) -> Response:
    return _json(load(state))


async def render_chat_completion(state: ServerState, request: Request, request_id: str) -> Response:
    req = await state.parse_body(request, ChatCompletionRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    setup = await prepare_chat(engine.engine, req)
    ids = setup.rendered.token_ids
    return _json(RenderResponse(request_id=f"chatcmpl-{request_id}", token_ids=ids, model=state.model_name))


async def render_completion(state: ServerState, request: Request, request_id: str) -> Response:
    req = await state.parse_body(request, CompletionRequest)
    engine = state.ready_engine()
    state.check_model(req.model)
    prompts = completion_prompts(req)  # an empty batch is its 400
    ids = await asyncio.to_thread(_prompt_ids, engine.engine.tokenizer, prompts)
    return _json(
        RenderList(
            [
                RenderResponse(request_id=f"cmpl-{request_id}-{k}", token_ids=t, model=state.model_name)
                for k, t in enumerate(ids)
            ]
        )
    )


async def flush_cache(state: ServerState, request: Request, request_id: str) -> Response:
    """Dropped on the engine thread between steps (AsyncEngine.reset_prefix_cache); 503 once dead."""
    await state.ready_engine().reset_prefix_cache()
    return _json(FlushCacheResponse())


def _prompt_ids(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """As the completion route sends them: text with the tokenizer's BOS, token ids as they are."""
    return [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True) for p in prompts]


def model_info(state: ServerState) -> ModelInfoResponse:
    engine = state.ready_engine().engine  # 503 while loading or once dead
    tok = engine.tokenizer
    name = engine.parts.model_name
    return ModelInfoResponse(
        model_path=name,
        served_model_name=state.model_name,
        tokenizer_path=name,
        max_context_length=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        architectures=[engine.model_config.architecture],
        eos_token_ids=sorted(tok.eos_token_ids),
        bos_token_id=tok.bos_token_id,
    )


def server_info(state: ServerState) -> ServerInfoResponse:
    async_engine = state.ready_engine()
    engine = async_engine.engine
    bm, cfg = engine.block_manager, engine.config
    name = engine.parts.model_name
    shape = engine.model_config.linear_state_shape
    return ServerInfoResponse(
        model_path=name,
        served_model_name=state.model_name,
        tokenizer_path=name,
        version=__version__,
        max_total_num_tokens=bm.num_blocks * bm.block_size,
        max_running_requests=cfg.max_num_seqs,
        max_queued_requests=async_engine.max_waiting,
        max_prefill_tokens=cfg.max_num_batched_tokens,
        chunked_prefill_size=cfg.max_num_batched_tokens,
        context_length=engine.max_model_len,
        page_size=bm.block_size,
        num_kv_blocks=bm.num_blocks,
        disable_radix_cache=not cfg.enable_prefix_caching,
        state_bytes_per_sequence=None if shape is None else shape.bytes_per_slot(engine.parts.dtype),
        max_state_snapshots=None if shape is None else cfg.num_state_snapshots,
        device=str(engine.device),
        dtype=str(engine.parts.dtype).removeprefix("torch."),
        internal_states=[_internal_state(engine)],
    )


def load(state: ServerState) -> LoadResponse:
    engine = state.ready_engine().engine
    running, waiting = engine.num_running, engine.num_waiting
    return LoadResponse(
        load=running + waiting,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_tokens=engine.block_manager.num_used_blocks * engine.block_manager.block_size,
    )


def _internal_state(engine: Engine) -> InternalState:
    bm, stats = engine.block_manager, engine.stats
    slots = engine.scheduler.state_slots
    queried = stats.num_prefix_cache_query_tokens_total
    return InternalState(
        num_running_reqs=engine.num_running,
        num_waiting_reqs=engine.num_waiting,
        num_used_tokens=bm.num_used_blocks * bm.block_size,
        kv_cache_usage=bm.usage,
        num_free_blocks=bm.num_free_blocks,
        num_cached_blocks=bm.num_evictable_blocks,
        prefix_cache_hit_rate=stats.num_prefix_cache_hit_tokens_total / queried if queried else None,
        num_state_snapshots=None if slots is None else slots.num_snapshots_held,
    )


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
