"""POST /v1/completions: a raw prompt (text or token ids), no chat template.

    1. parse and validate (400/413), check the engine (503) and the model (404)
    2. a text prompt is tokenized here, in a worker thread, exactly as the engine would
       (BOS where the tokenizer asks for it), so the engine thread never tokenizes a long text
    3. what the output must match (response_format or structured_outputs), compiled in a worker
       thread (a 400 naming the field if it cannot be); one SamplingParams per choice; add all
       choices (typed errors before any byte is sent)
    4. a response, or SSE chunks (object "text_completion" for both, as OpenAI does); with echo
       the prompt text leads each choice (in its first chunk when streaming)

Logprobs use the completions format: tokens, token_logprobs, top_logprobs ({token: logprob}) and
text_offset (character offset of each token in the choice's text, echo included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from onecall.engine.engine import RequestOutput
from onecall.server.http_errors import http_error
from onecall.server.params import completion_prompt, requested_structured_outputs, to_sampling_params
from onecall.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from onecall.server.serving_common import Generation, cancel_on_disconnect, clamp_logprob, token_text
from onecall.server.serving_structured import compile_structured_outputs
from onecall.server.sse import DONE, SSEResponse, sse_event
from onecall.server.state import ServerState
from onecall.text.chat_template import RenderedPrompt
from onecall.text.tokenizer import Tokenizer


async def create_completion(state: ServerState, request: Request, request_id: str) -> Response:
    # 1. request, engine, model
    req = await state.parse_body(request, CompletionRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    # 2. prompt
    prompt = completion_prompt(req)
    if isinstance(prompt, str):
        prompt_input: str | list[int] | RenderedPrompt = await asyncio.to_thread(
            _tokenized, tokenizer, prompt
        )
    else:
        prompt_input = prompt
    # 3. structured outputs, params, add
    asked = requested_structured_outputs(req)
    if asked is not None:
        await compile_structured_outputs(engine.engine, *asked)
    so = asked[0] if asked is not None else None
    params = to_sampling_params(req, default_max_tokens=req.max_tokens, structured_outputs=so)
    cmpl_id = f"cmpl-{request_id}"
    gen = await Generation.start(engine, cmpl_id, prompt_input, params)
    echo = _echo_text(tokenizer, prompt) if req.echo else ""
    # 4. answer
    head = CompletionResponse(id=cmpl_id, created=int(time.time()), model=state.model_name, choices=[])
    if req.stream:
        await gen.first_outputs(request)
        return SSEResponse(_completion_events(gen, req, head, tokenizer, echo), cleanup=gen.close)
    finals = await cancel_on_disconnect(request, gen.collect())
    choices = [_choice(i, out, req, tokenizer, echo) for i, out in enumerate(finals)]
    trace = gen.trace() if req.trace else None
    response = head.model_copy(update={"choices": choices, "usage": gen.usage(), "trace": trace})
    return Response(response.model_dump_json(), media_type="application/json")


def _choice(
    index: int, out: RequestOutput, req: CompletionRequest, tokenizer: Tokenizer, echo: str
) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None:
        logprobs = _logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs, len(echo))
    return CompletionChoice(
        index=index, text=echo + out.text, logprobs=logprobs, finish_reason=out.finish_reason
    )


def _echo_text(tokenizer: Tokenizer, prompt: str | list[int]) -> str:
    """The prompt as sent; token ids as their text, control tokens included."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)


def _tokenized(tokenizer: Tokenizer, text: str) -> RenderedPrompt:
    ids = tokenizer.encode(text, add_special_tokens=True)
    special = tokenizer.special_ids
    return RenderedPrompt(text=text, token_ids=ids, is_control=[i in special for i in ids])


async def _completion_events(
    gen: Generation, req: CompletionRequest, head: CompletionResponse, tokenizer: Tokenizer, echo: str
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    offsets = [len(echo)] * req.n  # characters sent so far per choice, for text_offset

    def chunk(choices: list[CompletionChoice], **extra: object) -> bytes:
        return sse_event(head.model_copy(update={"choices": choices, **extra}))

    try:
        if echo:
            for i in range(req.n):
                yield chunk([CompletionChoice(index=i, text=echo, finish_reason=None)])
        async for d in gen.deltas():
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            logprobs = None
            if req.logprobs is not None and d.token_ids:
                logprobs = _logprobs(tokenizer, d.token_ids, d.logprobs, d.top_logprobs, offsets[d.index])
            offsets[d.index] += len(d.text)
            choice = CompletionChoice(
                index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason
            )
            trace = gen.trace() if req.trace and d.is_last and not include_usage else None
            yield chunk([choice], trace=trace)
        if include_usage:
            yield chunk([], usage=gen.usage(), trace=gen.trace() if req.trace else None)
    except Exception as e:  # after the 200 went out: the error is an event, then [DONE]
        yield sse_event(http_error(e, head.id).body())
    finally:
        await gen.close()
    yield DONE


def _logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[float | None] | None,
    top_logprobs: list[list[tuple[int, float]] | None] | None,
    offset: int,
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    lps, tops = logprobs or [], top_logprobs or []
    for k, tid in enumerate(token_ids):
        text = token_text(tokenizer, tid)
        out.tokens.append(text)
        out.token_logprobs.append(clamp_logprob(lps[k] if k < len(lps) else None))
        alternatives = tops[k] if k < len(tops) else None
        out.top_logprobs.append({token_text(tokenizer, t): clamp_logprob(v) for t, v in alternatives or ()})
        out.text_offset.append(offset)
        offset += len(text)
    return out
