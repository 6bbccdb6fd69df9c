"""POST /v1/completions: raw prompts (text or token ids), no chat template.

    1. parse and validate (400/413), check the engine (503) and the model (404); turn the request
       into one SamplingParams per candidate (n, or best_of) and refuse what cannot be served
    2. the prompts: one, or a batch (a list of texts or of token-id lists); all of them times the
       candidates count against the waiting-queue limit together. Text prompts are tokenized here,
       in a worker thread, exactly as the engine would (BOS where the tokenizer asks for it)
    3. what the output must match (response_format or structured_outputs), compiled in a worker
       thread (a 400 naming the field if it cannot be); add every (prompt, candidate) request at
       once, all or nothing (typed errors before any byte is sent)
    4. a response, or SSE chunks (object "text_completion" for both, as OpenAI does)

Choices are numbered prompt-major, as OpenAI and vLLM do: choice prompt_index * n + i. Engine
request k of the batch is candidate k % c of prompt k // c (c = best_of or n); with best_of > n
the n candidates with the highest cumulative logprob are kept, best first (vLLM's ranking; streaming
is refused then, as OpenAI does). Usage counts each prompt once and every generated token, the
discarded candidates' included (they were computed).

echo: the prompt text leads each choice's text (in its first chunk when streaming). With logprobs
too, the prompt's own tokens lead the logprobs: token_logprobs and top_logprobs None for the first
token (nothing predicts it), then the engine's prompt logprobs (SamplingParams.prompt_logprobs),
then the generated tokens'. max_tokens 0 with echo scores the prompt: the choice is just the prompt.

Logprobs use the completions format: tokens, token_logprobs, top_logprobs ({token: logprob}) and
text_offset (character offset of each token in the choice's text, echo included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence

from fastapi import Request
from fastapi.responses import Response

from onecall.engine.engine import RequestOutput
from onecall.errors import InvalidParameterError
from onecall.server.http_errors import http_error
from onecall.server.params import completion_prompts, requested_structured_outputs, to_sampling_params
from onecall.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Trace,
)
from onecall.server.serving_common import Generation, cancel_on_disconnect, clamp_logprob, token_text
from onecall.server.serving_structured import compile_structured_outputs
from onecall.server.sse import DONE, SSEResponse, sse_event
from onecall.server.state import ServerState
from onecall.text.chat_template import RenderedPrompt
from onecall.text.tokenizer import Tokenizer

Logprobs = list[float | None] | None
TopLogprobs = list[list[tuple[int, float]] | None] | None


async def create_completion(state: ServerState, request: Request, request_id: str) -> Response:
    # 1. request, engine, model, parameters (refusals come before any tokenizing)
    req = await state.parse_body(request, CompletionRequest)
    engine = state.ready_engine()  # first: the model's name is known once it is loaded
    state.check_model(req.model)
    tokenizer = engine.engine.tokenizer
    asked = requested_structured_outputs(req)
    so = asked[0] if asked is not None else None
    params = to_sampling_params(req, default_max_tokens=req.max_tokens, structured_outputs=so)
    # 2. prompts
    prompts = completion_prompts(req)
    _check_batch_size(req, len(prompts), len(params), engine.max_waiting)
    inputs = await asyncio.to_thread(_prompt_inputs, tokenizer, prompts)
    # 3. structured outputs, add
    # held until the requests are queued, so the engine thread finds it compiled (serving_structured)
    _held_grammar = await compile_structured_outputs(engine.engine, *asked) if asked is not None else None
    cmpl_id = f"cmpl-{request_id}"
    c = len(params)  # candidates per prompt
    items = [(f"{cmpl_id}-{k}", inputs[k // c], params[k % c]) for k in range(len(prompts) * c)]
    gen = Generation(await engine.add_requests(items), tokenizer, per_prompt=c)
    gen.spans = state.request_spans(request, "text_completion", cmpl_id, stream=bool(req.stream), n=req.n)
    echoes = [_echo_text(tokenizer, p) if req.echo else "" for p in prompts]
    # 4. answer
    head = CompletionResponse(id=cmpl_id, created=int(time.time()), model=state.model_name, choices=[])
    if req.stream:  # best_of > n was refused: candidates are the choices
        await gen.first_outputs(request)
        return SSEResponse(_completion_events(gen, req, head, tokenizer, echoes), cleanup=gen.close)
    finals = await cancel_on_disconnect(request, gen.collect())
    chosen = [best_candidates(finals[k * c : (k + 1) * c], req.n) for k in range(len(prompts))]
    choices = [
        _choice(k * req.n + i, out, req, tokenizer, echoes[k])
        for k, outs in enumerate(chosen)
        for i, out in enumerate(outs)
    ]
    trace = _trace(tokenizer, chosen) if req.trace else None
    response = head.model_copy(update={"choices": choices, "usage": gen.usage(), "trace": trace})
    return Response(response.model_dump_json(), media_type="application/json")


def best_candidates(candidates: Sequence[RequestOutput], n: int) -> list[RequestOutput]:
    """best_of: the n candidates with the highest cumulative logprob, best first (ties keep their
    order). With as many candidates as choices, all of them in their own order."""
    if len(candidates) == n:
        return list(candidates)

    def score(out: RequestOutput) -> float:
        assert out.cumulative_logprob is not None, "best_of > n turns logprobs on (server/params.py)"
        return out.cumulative_logprob

    return sorted(candidates, key=score, reverse=True)[:n]  # sorted() is stable, reverse too


def _check_batch_size(req: CompletionRequest, num_prompts: int, num_candidates: int, limit: int) -> None:
    """Every (prompt, candidate) pair is one engine request: a batch that could never wait in the
    queue at once is a 400 (one that does not fit now is the engine's 429)."""
    total = num_prompts * num_candidates
    if total > limit:
        param = "prompt" if num_prompts > 1 else ("best_of" if req.best_of else "n")
        raise InvalidParameterError(
            param,
            f"{num_prompts} prompt(s) x {num_candidates} choices = {total} requests, but at most "
            f"{limit} may wait at once",
        )


def _prompt_inputs(
    tokenizer: Tokenizer, prompts: list[str | list[int]]
) -> list[str | list[int] | RenderedPrompt]:
    return [_tokenized(tokenizer, p) if isinstance(p, str) else p for p in prompts]


def _tokenized(tokenizer: Tokenizer, text: str) -> RenderedPrompt:
    ids = tokenizer.encode(text, add_special_tokens=True)
    special = tokenizer.special_ids
    return RenderedPrompt(text=text, token_ids=ids, is_control=[i in special for i in ids])


def _echo_text(tokenizer: Tokenizer, prompt: str | list[int]) -> str:
    """The prompt as sent; token ids as their text, control tokens included."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)


def _choice(
    index: int, out: RequestOutput, req: CompletionRequest, tokenizer: Tokenizer, echo: str
) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None:
        logprobs = _prompt_logprobs(tokenizer, out) if req.echo else CompletionLogprobs()
        _add_logprobs(logprobs, tokenizer, out.token_ids, out.logprobs, out.top_logprobs, len(echo))
    return CompletionChoice(
        index=index, text=echo + out.text, logprobs=logprobs, finish_reason=out.finish_reason
    )


def _trace(tokenizer: Tokenizer, chosen: list[list[RequestOutput]]) -> Trace:
    """The returned choices' traces, in choice order: a dict for one choice, else a list. Each
    prompt's group goes through Generation.trace(), which decodes that prompt's tokens once."""
    traces: list[dict[str, object]] = []
    for outs in chosen:
        group = Generation([], tokenizer)
        group.finals.extend(outs)
        t = group.trace()
        traces += t if isinstance(t, list) else [t]
    return traces[0] if len(traces) == 1 else traces


async def _completion_events(
    gen: Generation, req: CompletionRequest, head: CompletionResponse, tokenizer: Tokenizer, echoes: list[str]
) -> AsyncGenerator[bytes, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    num_choices = len(gen.streams)
    offsets = [0] * num_choices  # characters sent so far per choice, for text_offset
    echoed = [not req.echo] * num_choices

    def chunk(choices: list[CompletionChoice], **extra: object) -> bytes:
        return sse_event(head.model_copy(update={"choices": choices, **extra}))

    def trace() -> Trace:
        finals = [f for f in gen.finals if f is not None]
        return _trace(tokenizer, [finals[k : k + req.n] for k in range(0, len(finals), req.n)])

    try:
        async for d in gen.deltas():
            if not echoed[d.index]:  # the choice's first output: the prompt (and its logprobs) first
                echoed[d.index] = True
                echo = echoes[d.index // req.n]
                lps = _prompt_logprobs(tokenizer, d.output) if req.logprobs is not None else None
                offsets[d.index] = len(echo)
                yield chunk([CompletionChoice(index=d.index, text=echo, logprobs=lps, finish_reason=None)])
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            logprobs = None
            if req.logprobs is not None and d.token_ids:
                logprobs = CompletionLogprobs()
                _add_logprobs(logprobs, tokenizer, d.token_ids, d.logprobs, d.top_logprobs, offsets[d.index])
            offsets[d.index] += len(d.text)
            choice = CompletionChoice(
                index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason
            )
            last_trace = trace() if req.trace and d.is_last and not include_usage else None
            yield chunk([choice], trace=last_trace)
        if include_usage:
            yield chunk([], usage=gen.usage(), trace=trace() if req.trace else None)
    except Exception as e:  # after the 200 went out: the error is an event, then [DONE]
        yield sse_event(http_error(e, head.id).body())
    finally:
        await gen.close()
    yield DONE


def _prompt_logprobs(tokenizer: Tokenizer, out: RequestOutput) -> CompletionLogprobs:
    """The prompt's tokens as echo shows them: the first with None (nothing predicts it, as OpenAI
    sends it), then the engine's prompt logprobs; offsets from 0. An output that ended before its
    prompt was computed (an abort) has none: its tokens come with the floor value."""
    lps, tops = out.prompt_logprobs or [], out.prompt_top_logprobs or []
    ids = out.prompt_token_ids
    result = CompletionLogprobs()
    first = token_text(tokenizer, ids[0])
    result.tokens.append(first)
    result.token_logprobs.append(None)
    result.top_logprobs.append(None)
    result.text_offset.append(0)
    _add_logprobs(result, tokenizer, ids[1:], lps[1:], tops[1:], len(first))
    return result


def _add_logprobs(
    into: CompletionLogprobs,
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: Logprobs,
    top_logprobs: TopLogprobs,
    offset: int,
) -> None:
    """Append each token's text, logprob, alternatives and text offset (starting at `offset`)."""
    lps, tops = logprobs or [], top_logprobs or []
    for k, tid in enumerate(token_ids):
        text = token_text(tokenizer, tid)
        into.tokens.append(text)
        into.token_logprobs.append(clamp_logprob(lps[k] if k < len(lps) else None))
        alternatives = tops[k] if k < len(tops) else None
        into.top_logprobs.append({token_text(tokenizer, t): clamp_logprob(v) for t, v in alternatives or ()})
        into.text_offset.append(offset)
        offset += len(text)
