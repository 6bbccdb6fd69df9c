"""Qwen3.5's tool calls (Qwen3-Coder's XML layout): one call's body scanned, its values typed by the
function's schema, and the grammar that forces such calls.

The template (tests/data/chat_templates/Qwen-Qwen3.5.jinja) asks for, and renders the history as,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is raw text between "<parameter=KEY>" and the first "</parameter>", less the one newline the
layout puts after the opening tag and the one before the closing tag. The template writes a string as
it is, a mapping or a list with tojson and anything else with Python's str() (True, 3, None), so a
value is typed by the parameter's schema (value_from_text): a string parameter keeps the text; other
types are read as JSON (True/False/None too); text that does not read as the schema's type stays a
string, as does a parameter the schema does not name.

Scanning is strict where a loose reading would be ambiguous: a value runs to the first "</parameter>"
(one that never closes is not guessed at: a "</tool_call>" before it makes the block no call, so its
text is content), and "</function>" must follow the last parameter. Only whitespace may stand between
the tags. scan_call() reads a body that may still be growing: it says
whether the text is a complete call, a prefix of one, or cannot become one.

The arguments JSON is written pair by pair (arguments_prefix): "{" then '"key": value' joined by ", ",
then "}", json.dumps's layout. A repeated parameter keeps its first value. A stream can send each
parameter's pair as soon as its "</parameter>" arrives, and the whole call's JSON starts with it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from onecall.sampling.json_schema import close_objects

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_WS = " \t\r\n"

ScanState = Literal["complete", "partial", "invalid"]


@dataclass
class XmlCallScan:
    """What scan_call() read of one call's body (the text after "<tool_call>")."""

    state: ScanState
    name: str | None = None  # once "<function=NAME>" is complete
    parameters: list[tuple[str, str]] = field(default_factory=list)  # (key, raw value), closed ones
    function_closed: bool = False  # "</function>" seen
    end: int = 0  # complete: index just past "</tool_call>"


def _is_prefix(text: str, literal: str) -> bool:
    return literal.startswith(text)


def scan_call(text: str, close_marker: str, names: Collection[str] | None) -> XmlCallScan:
    """Read `text` (after "<tool_call>") as far as it goes. `names`: the known functions (a call to
    another is invalid), None to accept any name."""
    scan = XmlCallScan("partial")
    pos = len(text) - len(text.lstrip(_WS))
    # 1. <function=NAME>
    head = text[pos : pos + len(FUNCTION_OPEN)]
    if not text.startswith(FUNCTION_OPEN, pos):
        scan.state = "partial" if _is_prefix(head, FUNCTION_OPEN) else "invalid"
        return scan
    pos += len(FUNCTION_OPEN)
    gt = text.find(">", pos)
    name = text[pos:gt] if gt >= 0 else text[pos:]
    if any(c in name for c in "<\n") or (gt >= 0 and not name):
        scan.state = "invalid"
        return scan
    if gt < 0:
        return scan
    if names is not None and name not in names:
        scan.state = "invalid"
        return scan
    scan.name, pos = name, gt + 1
    # 2. the parameters, each closed by the first "</parameter>", then "</function>"
    while True:
        pos = len(text) - len(text[pos:].lstrip(_WS))
        rest = text[pos:]
        if rest.startswith(PARAMETER_OPEN):
            gt = text.find(">", pos + len(PARAMETER_OPEN))
            key = text[pos + len(PARAMETER_OPEN) : gt] if gt >= 0 else text[pos + len(PARAMETER_OPEN) :]
            if any(c in key for c in "<\n") or (gt >= 0 and not key):
                scan.state = "invalid"
                return scan
            if gt < 0:
                return scan
            end = text.find(PARAMETER_CLOSE, gt + 1)
            stop = text.find(close_marker, gt + 1)
            if stop >= 0 and (end < 0 or stop < end):  # the block closed inside a value
                scan.state = "invalid"
                return scan
            if end < 0:
                return scan
            scan.parameters.append((key, _strip_layout(text[gt + 1 : end])))
            pos = end + len(PARAMETER_CLOSE)
        elif rest.startswith(FUNCTION_CLOSE):
            pos += len(FUNCTION_CLOSE)
            break
        else:
            if not (_is_prefix(rest, PARAMETER_OPEN) or _is_prefix(rest, FUNCTION_CLOSE)):
                scan.state = "invalid"
            return scan
    # 3. </tool_call>
    scan.function_closed = True
    pos = len(text) - len(text[pos:].lstrip(_WS))
    rest = text[pos:]
    if rest.startswith(close_marker):
        scan.state, scan.end = "complete", pos + len(close_marker)
    elif not _is_prefix(rest, close_marker):
        scan.state = "invalid"
    return scan


def _strip_layout(value: str) -> str:
    """The value less the newline after its opening tag and the one before its closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


# ---- typing values by schema -----------------------------------------------------------------------


def _schema_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema allows; None when it does not say (the value stays text)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    for literals in (schema.get("enum"), [schema["const"]] if "const" in schema else None):
        if isinstance(literals, list) and literals:
            return {_json_type(v) for v in literals}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list):
        found = [_schema_types(b) for b in branches]
        if all(f is not None for f in found):
            return set().union(*found)  # type: ignore[arg-type]
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


_PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # how the template writes them


def value_from_text(text: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema asks for (see the module docstring)."""
    types = _schema_types(schema)
    if types is None or types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        if text.strip() not in _PYTHON_LITERALS:
            return text
        value = _PYTHON_LITERALS[text.strip()]
    kind = _json_type(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    return text


def arguments_prefix(parameters: list[tuple[str, str]], schema: Any) -> str:
    """The arguments JSON of these parameters without its closing "}" (module docstring)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    pairs, seen = [], set()
    for key, text in parameters:
        if key in seen:
            continue
        seen.add(key)
        value = value_from_text(text, properties.get(key))
        pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
    return "{" + ", ".join(pairs)


# ---- the forced call's grammar ---------------------------------------------------------------------

# A string value: any text up to its first "</parameter>", which must follow a newline, and without
# "</tool_call>" (the parser would end the block there). One token that holds "</parameter>" only once,
# at its end, so the lexer knows where the value stops.
_PARAM_TEXT = (
    r"/(.|\n)*\n<\/parameter>\n/ & ~/(.|\n)*<\/parameter>(.|\n)*<\/parameter>(.|\n)*/"
    r" & ~/(.|\n)*<\/tool_call>(.|\n)*/"
)
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _value_rule(schema: Any) -> str:
    """A parameter's value and its closing tag, as Lark."""
    types = _schema_types(schema)
    if types is None or types == {"string"}:
        enum = schema.get("enum") if isinstance(schema, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(json.dumps(f"{v}\n</parameter>\n") for v in enum) + ")"
        return "PARAM_TEXT"
    closed = close_objects(schema)
    return f'%json {json.dumps(closed | {"x-guidance": dict(_JSON_LAYOUT)})} "\\n</parameter>\\n"'


def xml_tool_call_grammar(
    functions: list[tuple[str, dict[str, Any]]],
    *,
    parallel: bool,
    special_markers: bool = False,
) -> str:
    """llguidance Lark grammar for Qwen3.5 calls of `functions` ((name, parameters schema) pairs): each
    call `<tool_call>\\n<function=NAME>\\n` + parameters + `</function>\\n</tool_call>`, once or with
    `parallel` one or more separated by "\\n"; the output may end after any complete call with or
    without a "\\n" (as the hermes grammar, tools/specs.py tool_call_grammar). Up to two newlines may
    come first: the template writes "</think>\\n\\n" before an answer, so a model that has just closed
    its reasoning (the grammar waits for "</think>") is not forced off its own layout.

    Parameters come in the schema's `properties` order, each written once: a required one must be
    there, an optional one may be left out (a model that writes them in another order is held to
    this one). A string parameter is free text without "</parameter>" (or one of its enum values);
    any other is its JSON by the property's schema (%json, objects closed, json.dumps's layout)."""
    open_, close = ("<tool_call>", "</tool_call>") if special_markers else ('"<tool_call>"', '"</tool_call>"')
    repeat = ' ("\\n" call)*' if parallel else ""
    lines = [
        f'start: "\\n"? "\\n"? call{repeat} "\\n"?',
        "call: " + " | ".join(f"fn_{i}" for i in range(len(functions))),
    ]
    for i, (name, schema) in enumerate(functions):
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        items = []
        for j, (key, prop) in enumerate(properties.items()):
            lines.append(f"p_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {_value_rule(prop)}")
            items.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        head = json.dumps(f"\n<function={name}>\n")
        lines.append(f'fn_{i}: {open_} {head} {" ".join(items)} "</function>\\n" {close}')
    lines.append(f"PARAM_TEXT: {_PARAM_TEXT}")
    return "\n".join(lines) + "\n"
