"""Tools as the request gives them: validate `tools`/`tool_choice`, describe them, enforce calls.

Four formats, chosen per model by ToolFormat.for_template() (see tools/calls.py for the outputs):
hermes, where the template renders tools itself (Qwen2.5, Qwen3), xml, the same with Qwen3-Coder's
<function=...><parameter=...> calls (Qwen3.5; parsed and enforced by tools/xml_calls.py), gemma4, the
same with Gemma 4's <|tool_call>call:NAME{key:value}<tool_call|> calls (tools/gemma4_calls.py), and
json, a convention for templates that know no tools (the embedded SmolLM2): tools_system_prompt() goes into the system
message and the model answers with {"tool_calls": [{"name": ..., "arguments": {...}}]}.

Enforcement (tool_choice "required" or a named function) uses tool_call_schema() (json format) or
tool_call_grammar() (hermes, llguidance's Lark dialect with an inline %json schema). Both pin the JSON
layout to json.dumps's separators (", " and ": ", no other whitespace), what the models were shown.
Every validation error is an InvalidParameterError naming the parameter.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from onecall.errors import InvalidParameterError
from onecall.sampling.json_schema import close_objects

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_OPEN, _CLOSE = TOOL_CALL_OPEN, TOOL_CALL_CLOSE
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolFormat(StrEnum):
    HERMES = "hermes"
    JSON = "json"
    XML = "qwen3_xml"
    GEMMA4 = "gemma4"

    @classmethod
    def for_template(cls, chat_template: str | None) -> ToolFormat:
        """GEMMA4 when the template writes Gemma 4's `<|tool_call>call:NAME{...}` calls, XML when its
        <tool_call> blocks hold <function=...>/<parameter=...> tags (Qwen3.5, Qwen3-Coder), HERMES when
        they hold JSON, else the JSON convention."""
        if chat_template and "<|tool_call>" in chat_template and "call:" in chat_template:
            return cls.GEMMA4
        if not chat_template or _OPEN not in chat_template:
            return cls.JSON
        if "<function=" in chat_template and "<parameter=" in chat_template:
            return cls.XML
        return cls.HERMES


@dataclass(frozen=True)
class ToolFunction:
    """One validated function from `tools`."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """A validated (tools, tool_choice) pair. A named function is mode "required" with `name` set."""

    mode: Literal["none", "auto", "required"]
    name: str | None
    functions: tuple[ToolFunction, ...]


# ---- validation -------------------------------------------------------------------------------------


def tool_functions(tools: Any) -> tuple[ToolFunction, ...]:
    """Validate an OpenAI `tools` list; InvalidParameterError names the first thing wrong."""
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", f"must be a list of tool objects, got {type(tools).__name__}")
    if not tools:
        raise InvalidParameterError("tools", "must not be empty (omit `tools` to offer none)")
    functions: list[ToolFunction] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidParameterError(f"{where}.type", 'each tool must be {"type": "function", ...}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidParameterError(f"{where}.function", "is missing or not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise InvalidParameterError(
                f"{where}.function.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}"
            )
        if any(f.name == name for f in functions):
            raise InvalidParameterError(f"{where}.function.name", f"duplicate function name {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidParameterError(
                f"{where}.function.parameters", 'must be a JSON Schema object with "type": "object"'
            )
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise InvalidParameterError(f"{where}.function.description", "must be a string")
        functions.append(ToolFunction(name, description, params))
    return tuple(functions)


def validate_tools(tools: Any, tool_choice: Any) -> ToolChoice:
    """Check `tools` and `tool_choice` together, before any token is generated. An empty `tools` list
    offers none, as OpenAI takes it (the Agents SDK sends `tools: []` for every agent without tools),
    and then "auto" or "none" means none."""
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice is not None and not (tools == [] and tool_choice in ("auto", "none")):
            what = (
                "is only allowed when `tools` are given"
                if tools is None
                else "asks for a call, but `tools` is empty"
            )
            raise InvalidParameterError("tool_choice", what)
        return ToolChoice("none", None, ())
    functions = tool_functions(tools)
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return ToolChoice(tool_choice or "auto", None, functions)
    choice = tool_choice if isinstance(tool_choice, dict) else {"type": None}
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidParameterError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    _find(functions, name)
    return ToolChoice("required", name, functions)


def _find(functions: tuple[ToolFunction, ...], name: str) -> ToolFunction:
    for f in functions:
        if f.name == name:
            return f
    available = ", ".join(f.name for f in functions)
    raise InvalidParameterError(
        "tool_choice", f"names function {name!r}, which is not in tools (available: {available})"
    )


# ---- the json convention: prompt and message rewriting ----------------------------------------------------


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text that teaches a template-less model the json convention."""
    lines = [
        json.dumps(
            {"name": f.name, "description": f.description, "parameters": f.parameters}, ensure_ascii=False
        )
        for f in tool_functions(tools)
    ]
    return (
        "# Tools\n\n"
        "You can call the functions below. Each is a JSON object with its name, a description and its "
        "parameters as a JSON Schema:\n" + "\n".join(lines) + "\n\n"
        "To call functions, reply with only a JSON object of this form and no other text:\n"
        '{"tool_calls": [{"name": "function_name", "arguments": {"argument_name": "value"}}]}\n'
        'Put one entry in "tool_calls" per call; "arguments" is a JSON object that matches the '
        "function's parameters.\n"
        "If no function is needed, answer in plain text instead."
    )


def messages_for_json_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation as a template with no tool format can render it: tools_system_prompt() appended
    to the first system message (or a new one in front), and assistant tool_calls written back as the
    convention's JSON (their content otherwise is often None, which such templates cannot render).
    `tool` messages keep their role and content. With tools None (none offered) only the tool_calls
    are rewritten, so a history with calls still renders. The input is not modified."""
    out = [_with_calls_as_text(m) for m in messages]
    if tools is None:
        return out
    prompt = tools_system_prompt(tools)
    if out and out[0].get("role") == "system":
        first = out[0].get("content")
        if isinstance(first, list):
            out[0] = {**out[0], "content": [*first, {"type": "text", "text": prompt}]}
        else:
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return dict(message)
    entries = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "{}")
        with contextlib.suppress(ValueError):  # if not JSON, the model sees the string it was sent
            args = json.loads(args) if isinstance(args, str) else args
        entries.append({"name": fn.get("name"), "arguments": args})
    text = json.dumps({"tool_calls": entries}, ensure_ascii=False)
    content = message.get("content")
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{content}\n{text}" if isinstance(content, str) and content else text}


# ---- enforcement: JSON Schema and Lark grammar ---------------------------------------------------------


def _call_schema(functions: tuple[ToolFunction, ...], *, close: bool = False) -> dict[str, Any]:
    """One call's schema; `close`: each function's parameters with their objects closed."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": close_objects(f.parameters) if close else f.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _enforced(tools: list[dict[str, Any]], required_name: str | None) -> tuple[ToolFunction, ...]:
    functions = tool_functions(tools)
    return (_find(functions, required_name),) if required_name is not None else functions


def tool_call_schema(
    tools: list[dict[str, Any]], *, required_name: str | None = None, parallel: bool = True
) -> dict[str, Any]:
    """JSON Schema of the json convention's answer for tool_choice "required" (any tool, one call or,
    with `parallel`, one or more) or a named function (exactly one call of it, as OpenAI does)."""
    max_items = {} if parallel and required_name is None else {"maxItems": 1}
    return {
        "type": "object",
        "properties": {
            "tool_calls": {
                "type": "array",
                "items": _call_schema(_enforced(tools, required_name)),
                "minItems": 1,
            }
            | max_items
        },
        "required": ["tool_calls"],
        "additionalProperties": False,
        "x-guidance": dict(_JSON_LAYOUT),  # a copy per schema: callers may edit theirs
    }


def tool_call_grammar(
    tools: list[dict[str, Any]],
    *,
    required_name: str | None = None,
    parallel: bool = True,
    special_markers: bool = False,
) -> str:
    """llguidance Lark grammar for hermes calls: `<tool_call>\\n{json}\\n</tool_call>`, once, or with
    `parallel` (and no named function) one or more times separated by "\\n". special_markers writes the
    markers as special-token references (<tool_call>) for a tokenizer that holds them as such.

    The output may end after any complete call, with or without the separator: Qwen's tokenizer has
    one token for ">\\n", which a model writes after "</tool_call" (as its template does) and which
    would otherwise commit it to another call, again and again until max_tokens, whatever it wanted
    (it was 0.7 on its end-of-text token there)."""
    # %json takes the schema as written: close the parameters' objects here (the json convention's
    # schema gets that from StructuredOutputsParams), so the model cannot invent argument keys
    schema = _call_schema(_enforced(tools, required_name), close=True)
    body = json.dumps(schema | {"x-guidance": dict(_JSON_LAYOUT)})
    open_, close = ("<tool_call>", "</tool_call>") if special_markers else ('"<tool_call>"', '"</tool_call>"')
    repeat = ' ("\\n" call)*' if parallel and required_name is None else ""
    return f'start: call{repeat} "\\n"?\ncall: {open_} "\\n" body "\\n" {close}\nbody: %json {body}\n'
