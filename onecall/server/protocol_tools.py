"""Wire models for structured outputs and tool calls (OpenAI's shapes): pure pydantic.

    request   response_format: {"type": "text"} | {"type": "json_object"}
                             | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response  message.tool_calls[i]   {"id", "type": "function", "function": {"name", "arguments"}}
    stream    delta.tool_calls[i]     {"index", "id", "type", "function": {"name", "arguments"}}: id,
                                      type and name in a call's first delta only, then argument fragments

`arguments` is always a JSON object written as a string, as OpenAI sends it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from onecall.server.protocol_base import RequestModel, ResponseModel


# ---- requests ----------------------------------------------------------------------------------------
class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow pydantic
    strict: bool | None = None  # objects are closed either way (sampling/json_schema.py)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # required for type "json_schema"


# ---- responses ---------------------------------------------------------------------------------------
class FunctionCall(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    omit_if_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    omit_if_none = frozenset({"id", "type", "function"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
