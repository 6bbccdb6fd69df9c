"""The OpenAI wire schema: request and response models, pure pydantic.

This module imports neither torch, the web framework nor the engine (a test checks it), and holds
no engine logic: conversion to SamplingParams lives in server/params.py, in one function.

Requests are validated strictly (a string where a number belongs, or a bool where an integer
belongs, is a 400, as OpenAI does) and unknown fields are ignored, since clients add new ones.
Limits that belong to the protocol rather than to sampling (n, top_logprobs) are checked here;
sampling ranges (temperature, top_p, penalties...) are SamplingParams' job.

Responses are built from these models and serialized with `model_dump_json()`; fields listed in
a model's `omit_if_none` are left out when None (a delta's role after the first chunk, usage on
all but the last chunk, trace unless asked for), every other field is always written.

Extensions beyond OpenAI (as vLLM names them): top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, chat_template_kwargs, add_generation_prompt,
`structured_outputs` (exactly one of json, regex, choice, grammar: StructuredOutputsParams'
fields), `reasoning_content` on messages and deltas (a thinking template's <think> block), and
`trace`: the engine's per-request trace (RequestTrace.to_dict()) in the response: a dict, or a
list of dicts in choice order when n > 1; when streaming, on the last chunk before [DONE] (the
usage chunk when stream_options.include_usage is set, else the chunk with the last finish_reason).
`trace_level`: "basic" (the default) or "full", which adds each output token's logit provenance
to its decode step (`steps[i].provenance`) and turns `trace` on. `cache_salt`: requests share
prefix-cache entries only with requests of the same salt (the trace shows a hash of it).
The response_format and tool-call shapes live in protocol_tools.py, the base classes in
protocol_base.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from onecall.server.protocol_base import RequestModel as _Request
from onecall.server.protocol_base import ResponseModel as _Response
from onecall.server.protocol_tools import DeltaToolCall, ResponseFormat, ToolCall

MAX_N = 16  # most choices per request (each is its own engine request)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs; equals SamplingParams' MAX_LOGPROBS
MAX_CACHE_SALT = 1024  # characters; equals SamplingParams' MAX_CACHE_SALT


# ---- requests --------------------------------------------------------------------------------------
class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message. Extra fields (name, reasoning_content, ...) are kept for the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None: the one served model
    n: int = Field(default=1, ge=1, le=MAX_N)  # choice i is sampled with seed + i (when seed is set)
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    trace: bool = False
    trace_level: Literal["basic", "full"] = "basic"  # "full": logit provenance per token; implies trace
    # prefix-cache entries are shared only between requests with the same salt (vLLM's field)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)

    @model_validator(mode="after")
    def _full_trace_implies_trace(self) -> _SamplingFields:
        if self.trace_level == "full":
            self.trace = True
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: what is left of the context window
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # validated by tools/specs.validate_tools
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: true
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # extension: StructuredOutputsParams.from_dict
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template: Any = None  # refused when set: templates come from the model only
    echo: bool = False  # refused when true: echo is a text-completions field


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a batch (a list of texts, or of token-id lists): choice
    # index = prompt index * n + i, as OpenAI and vLLM number them.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)  # OpenAI's default; 0 only with echo (score the prompt)
    echo: bool = False  # the prompt leads each choice's text (and its logprobs, with logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # >= n; the n likeliest are returned
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    suffix: str | None = None  # refused when set

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, value: Any) -> Any:
        """A list holds one kind of item: the union's own error would list every branch."""
        if isinstance(value, list) and value:
            kinds = {"token id" if isinstance(v, int) else type(v).__name__ for v in value}
            if len(kinds) > 1:
                raise ValueError(
                    f"a list of prompts holds one kind of item (strings, token ids, or token-id lists); "
                    f"got {', '.join(sorted(kinds))}"
                )
        return value


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a plain prompt or chat messages (rendered with the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses: shared ------------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


Trace = dict[str, Any] | list[dict[str, Any]]


# ---- responses: chat --------------------------------------------------------------------------------
class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatResponseMessage(_Response):
    omit_if_none = frozenset({"reasoning_content"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # a thinking template's <think> block
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    omit_if_none = frozenset({"trace"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    trace: Trace | None = None


class ChatDelta(_Response):
    omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    omit_if_none = frozenset({"usage", "trace"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    trace: Trace | None = None


# ---- responses: text completions ----------------------------------------------------------------------
class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    """Both the whole response and a streamed chunk (OpenAI uses the same object for both)."""

    omit_if_none = frozenset({"usage", "trace"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    trace: Trace | None = None


# ---- responses: models, tokenizer, health -----------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "onecall"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(_Response):
    """vLLM's GET /tokenizer_info: the tokenizer_config.json-like facts a client needs to tokenize and
    render as the server does (lm-eval's remote tokenizer reads eos_token, bos_token, chat_template)."""

    tokenizer_class: str  # where the server's tokenizer came from: "gguf" or "hf" (tokenizer.json)
    vocab_size: int
    model_max_length: int  # the server's context window (max_model_len)
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None = None  # onecall never pads
    add_bos_token: bool
    eos_token_ids: list[int]  # every id that ends generation (a template's end-of-turn included)
    chat_template: str | None


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"
