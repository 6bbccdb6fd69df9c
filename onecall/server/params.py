"""Wire requests -> engine inputs: SamplingParams (one function), template messages, prompts.

`to_sampling_params` is the only place a request becomes SamplingParams. It first refuses what
the protocol allows but we do not serve (stream_options without stream, a chat_template or echo
in a chat request, top_logprobs without logprobs, suffix, best_of < n, best_of > n when
streaming, max_tokens 0 without echo), then builds one SamplingParams per candidate (n, or
best_of for completions), all with the same `structured_outputs` (the caller's: it may add what
only the rendered prompt and the request's tools decide, see serving_structured.py).

Completions: echo with logprobs asks the engine for prompt_logprobs (the same N alternatives);
max_tokens 0 with echo is a scoring request (prompt_logprobs 0 when logprobs are not asked for,
so the engine has something to return); best_of > n turns on logprobs (0 alternatives) for the
cumulative logprob the server ranks candidates by, whether or not the response shows them.

`requested_structured_outputs` reads what the request itself asks the output to match:

    response_format {"type": "text"} or none         -> nothing
    response_format {"type": "json_object"}          -> StructuredOutputsParams(json_object=True)
    response_format {"type": "json_schema", ...}     -> StructuredOutputsParams(json=schema)
    structured_outputs {...} (the extension)         -> StructuredOutputsParams.from_dict(...)
    a JSON response_format and structured_outputs    -> 400: one or the other
 Every refusal is an InvalidParameterError naming the field;
SamplingParams' own range checks raise the same error, so the server maps both to a 400 with
`param` set.

Seeds and n: candidate i gets `seed + i` (candidates are separate engine requests, and equal
seeds would give n copies of one answer); without a seed every candidate samples freshly. Every
prompt of a batch gets the same list.

cache_salt: passed as the request has it, which is already the namespace the tenant runs in
(state.parse_body scopes it: server/tenants.py), so the engine keeps tenants apart by salt.

Imports neither torch nor the web framework: only the protocol, SamplingParams and the errors.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from onecall.errors import InvalidParameterError
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from onecall.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

AnyCompletionRequest = ChatCompletionRequest | CompletionRequest


def to_sampling_params(
    req: AnyCompletionRequest,
    *,
    default_max_tokens: int,
    structured_outputs: StructuredOutputsParams | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per candidate (len == req.n, or best_of for completions).
    `default_max_tokens` applies when the request names none (chat: what is left of the context
    window)."""
    _refuse_unsupported(req)
    num_candidates, prompt_logprobs = req.n, None
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
        num_candidates = req.best_of or req.n
        if num_candidates > req.n and logprobs is None:
            logprobs = 0  # the cumulative logprob ranks the candidates
        if req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
        elif max_tokens == 0:
            prompt_logprobs = 0  # echo only: a score-only request still needs its prompt computed
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    common: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs,
        trace_level=req.trace_level,
        cache_salt=req.cache_salt,
    )
    return [
        SamplingParams(seed=None if req.seed is None else req.seed + i, **common)
        for i in range(num_candidates)
    ]


def _refuse_unsupported(req: AnyCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidParameterError("stream_options", "may only be set when stream is true")
    if isinstance(req, ChatCompletionRequest):
        if req.chat_template is not None:
            raise InvalidParameterError(
                "chat_template", "is not accepted in a request: the template comes from the model"
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidParameterError("top_logprobs", "requires logprobs to be true")
        if req.echo:
            raise InvalidParameterError("echo", "is a /v1/completions field; chat completions do not echo")
        return
    if req.suffix is not None:
        raise InvalidParameterError("suffix", "is not supported")
    if req.best_of is not None and req.best_of < req.n:
        raise InvalidParameterError("best_of", f"must be >= n ({req.n}); got {req.best_of}")
    if req.best_of is not None and req.best_of > req.n and req.stream:
        raise InvalidParameterError(
            "best_of", f"cannot be streamed when greater than n ({req.best_of} > {req.n}): drop stream"
        )
    if req.max_tokens == 0 and not req.echo:
        raise InvalidParameterError("max_tokens", "0 is only accepted with echo (scoring the prompt)")


def requested_structured_outputs(req: AnyCompletionRequest) -> tuple[StructuredOutputsParams, str] | None:
    """What the request asks its output to match, with the field that asked (to name in errors)."""
    fmt, so = req.response_format, req.structured_outputs
    wants_format = fmt is not None and fmt.type != "text"
    if wants_format and so is not None:
        raise InvalidParameterError(
            "structured_outputs", "set either response_format or structured_outputs, not both"
        )
    if so is not None:
        return StructuredOutputsParams.from_dict(so), "structured_outputs"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidParameterError(
            "response_format", 'type "json_schema" needs {"json_schema": {"name": ..., "schema": {...}}}'
        )
    return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, i.e. strings: "123" -> 123."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidParameterError("logit_bias", f"keys must be token ids, got {key!r}") from None
    return out


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: plain dicts with extra fields kept, text parts as
    dicts (render_chat joins them), and tool-call arguments decoded from their JSON string (the
    wire form) to an object, which is what templates serialize with `tojson`, as vLLM does."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d["content"] = d.get("content")
        for call in d.get("tool_calls") or ():
            function = call.get("function")
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):  # not JSON: the template gets the string as sent
                    function["arguments"] = json.loads(function["arguments"])
        out.append(d)
    return out


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, in order: a string or a list of token ids is one
    prompt; a list of strings or of token-id lists is a batch. The protocol already refused lists
    that mix kinds; an empty list is refused here (an empty prompt inside one, by the engine)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameterError("prompt", "is an empty list: send a prompt, or a list of prompts")
    if isinstance(prompt[0], int):
        return [[t for t in prompt if isinstance(t, int)]]
    return [p for p in prompt if isinstance(p, (str, list))]
