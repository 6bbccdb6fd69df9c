"""POST /v1/chat/completions: messages -> the model's template -> n engine requests -> a response or SSE.

1. parse and validate the body (400/413), check the engine (503) and the model (404)
2. render the conversation with the model's own template, in a worker thread (a long
   conversation must not stall the event loop); tokens come with their control-token mask
3. one SamplingParams per choice (server/params.py), then add all choices at once: the engine's
   typed errors (context length, queue full) are answered before any byte of a stream
4. stream: per choice a first chunk with the role, content chunks as tokens arrive, exactly
   one finish_reason; usage (and the trace) in a last chunk with no choices when asked for
   not streaming: wait for every choice, cancelled if the client disconnects
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from onecall.engine.engine import RequestOutput
from onecall.errors import ContextLengthExceededError
from onecall.server.http_errors import HTTPError, http_error
from onecall.server.params import template_messages, to_sampling_params
from onecall.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    TokenLogprob,
    TopLogprob,
    Trace,
    Usage,
)
from onecall.server.serving_common import (
    Delta,
    Generation,
    cancel_on_disconnect,
    clamp_logprob,
    token_bytes,
    token_text,
)
from onecall.server.sse import DONE, SSEResponse, sse_event
from onecall.server.state import ServerState
from onecall.text.chat_template import render_chat
from onecall.text.tokenizer import Tokenizer


async def create_chat_completion(state: ServerState, request: Request, request_id: str) -> Response:
    # 1. request, engine, model
    req = await state.parse_body(request, ChatCompletionRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    # 2. render
    rendered = await asyncio.to_thread(
        render_chat,
        tokenizer,
        template_messages(req.messages),
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=req.chat_template_kwargs,
    )
    # 3. params, add
    room = engine.engine.max_model_len - len(rendered.token_ids)
    params = to_sampling_params(req, default_max_tokens=max(1, room))
    chat_id = f"chatcmpl-{request_id}"
    try:
        gen = await Generation.start(engine, chat_id, rendered, params)
    except ContextLengthExceededError as e:  # OpenAI names the messages, not a prompt, for chat
        raise HTTPError(400, str(e), param="messages", code="context_length_exceeded") from None
    # 4. answer
    head = _Head(chat_id, int(time.time()), state.model_name)
    if req.stream:
        return SSEResponse(_chat_events(gen, req, head, tokenizer), cleanup=gen.close)
    finals = await cancel_on_disconnect(request, gen.collect())
    response = ChatCompletionResponse(
        id=head.id,
        created=head.created,
        model=head.model,
        choices=[_choice(i, out, req, tokenizer) for i, out in enumerate(finals)],
        usage=gen.usage(),
        trace=gen.trace() if req.trace else None,
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(index: int, out: RequestOutput, req: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatChoice:
    logprobs = _logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs) if req.logprobs else None
    return ChatChoice(
        index=index,
        message=ChatResponseMessage(content=out.text),
        logprobs=logprobs,
        finish_reason=out.finish_reason,
    )


class _Head:
    """What every chunk of one response repeats."""

    def __init__(self, id: str, created: int, model: str) -> None:
        self.id, self.created, self.model = id, created, model

    def chunk(
        self, choices: list[ChatChunkChoice], *, usage: Usage | None = None, trace: Trace | None = None
    ) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage, trace=trace
            )
        )


async def _chat_events(
    gen: Generation, req: ChatCompletionRequest, head: _Head, tokenizer: Tokenizer
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        for i in range(req.n):
            yield head.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        async for d in gen.deltas():
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            choice = ChatChunkChoice(
                index=d.index,
                delta=ChatDelta(content=d.text),
                logprobs=_delta_logprobs(tokenizer, d) if req.logprobs and d.token_ids else None,
                finish_reason=d.finish_reason,
            )
            # the trace rides on the last chunk: this one, unless a usage chunk follows
            trace = gen.trace() if req.trace and d.is_last and not include_usage else None
            yield head.chunk([choice], trace=trace)
        if include_usage:
            yield head.chunk([], usage=gen.usage(), trace=gen.trace() if req.trace else None)
    except Exception as e:  # after the 200 went out: the error is an event, then [DONE]
        yield sse_event(http_error(e, head.id).body())
    finally:
        await gen.close()
    yield DONE


def _delta_logprobs(tokenizer: Tokenizer, d: Delta) -> ChatChoiceLogprobs:
    return _logprobs(tokenizer, d.token_ids, d.logprobs, d.top_logprobs)


def _logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None] | None,
    top_logprobs: list[list[tuple[int, float]] | None] | None,
) -> ChatChoiceLogprobs:
    """OpenAI's chat format: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    content = []
    lps = logprobs or []
    tops = top_logprobs or []
    for k, tid in enumerate(token_ids):
        alternatives = tops[k] if k < len(tops) else None
        content.append(
            TokenLogprob(
                token=token_text(tokenizer, tid),
                logprob=clamp_logprob(lps[k] if k < len(lps) else None),
                bytes=token_bytes(tokenizer, tid),
                top_logprobs=[
                    TopLogprob(
                        token=token_text(tokenizer, t),
                        logprob=clamp_logprob(v),
                        bytes=token_bytes(tokenizer, t),
                    )
                    for t, v in alternatives or ()
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)
