"""The Responses API's wire models (POST /v1/responses), as the official openai client sends and reads
them: pure pydantic, like protocol.py.

A request's `input` is a string or a list of items (messages with text content, earlier
`function_call` items and their `function_call_output`s); the server turns it into a chat request
(serving_responses.py). The server keeps no state between calls: `previous_response_id` and
`background` are refused by name, so a client always sends the whole conversation, as the seed's
first lesson says it does anyway.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from onecall.server.protocol_base import RequestModel as _Request
from onecall.server.protocol_base import ResponseModel as _Response


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "description", "parameters"}
    tool_choice: str | dict[str, Any] | None = (
        None  # "auto", "none", "required", {"type": "function", "name"}
    )
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    previous_response_id: str | None = None  # refused: the server is stateless
    background: bool | None = None  # refused
    store: bool | None = None  # nothing is stored, whatever it says
    metadata: dict[str, str] | None = None
    user: str | None = None
    # onecall's extensions, as on chat completions
    trace: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"] = "completed"


class InputTokensDetails(_Response):
    cached_tokens: int


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(_Response):
    """A Response (the fields the openai client requires, and the request's settings echoed)."""

    omit_if_none = frozenset({"trace"})

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    instructions: str | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None  # None while in progress (streamed response.created)
    error: None = None
    trace: Any = None
