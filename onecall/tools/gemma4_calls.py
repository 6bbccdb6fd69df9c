"""Gemma 4's tool calls: one call's body scanned and its values typed, the grammar that forces such
calls, and the history's tool results put where the template reads them.

The template (tests/data/chat_templates/google-gemma-4-31B-it-interleaved.jinja) declares each tool as
`<|tool>declaration:NAME{...}<tool|>` in the system turn, and asks for, and renders the history as,

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{hot:true,tags:[<|"|>a<|"|>]}}<tool_call|>

several calls back to back. Its format_argument writes a string between two `<|"|>` markers as it is
(no escaping: a string may hold commas, braces, newlines, anything but the marker), a boolean as
true/false, a mapping as `{key:value,...}` with its keys unquoted and sorted (Jinja's dictsort, which
ignores case), a list as `[value,...]`, and anything else with Python's str() (3, 1.5e-07, None).

scan_call() reads the text after `<|tool_call>` as far as it goes and says whether it is a complete
call, a prefix of one, or cannot become one; it keeps each top-level `key:value` pair as soon as its
value has closed, so a stream can send the arguments pair by pair. Values are typed as written: a
marked string is a string, an object or a list is one; a bare token is true/false, None/null, or a
number when it reads as one, else the text. The function's schema is read only for a bare token
(ambiguous: the marker forgotten, or a number?): under a string-only schema it stays the text as
written (`version:1.10` is "1.10", not 1.1). Keys may be bare or marked. Whitespace between tokens is
allowed; a repeated key keeps its first value. The arguments JSON is written pair by pair in the
order written (arguments_prefix), json.dumps's layout.

Strict where a loose reading would be ambiguous: a string runs to the next `<|"|>` (one that never
closes is not guessed at: at the end of the output the block is content if a `<tool_call|>` came
after it, else a call cut short, dropped; tools/calls.py's finish), the object must
close with `}` and then `<tool_call|>`; anything else makes the block no call (its text stays
content, up to the first `<tool_call|>`).

gemma4_tool_call_grammar() forces calls (tool_choice "required" or a named function), and
tool_responses_for_template() rewrites OpenAI `tool` messages into the template's tool_responses.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
MARKERS = (CALL_OPEN, CALL_CLOSE, QUOTE)
_HEAD = "call:"
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # OpenAI's rule for function names (tools/specs.py)
_WS = " \t\r\n"
_BARE_STOP = ",:{}[]<" + _WS  # what ends a bare key or value
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "True": True, "False": False, "None": None, "null": None}

_MAX_NESTING = 100  # a value nested deeper is not read (Python's recursion has a limit)

ScanState = Literal["complete", "partial", "invalid"]


class _Partial(Exception):
    """The text ended inside the call: more may make it one."""


class _Invalid(Exception):
    """The text cannot become a call."""


@dataclass
class Gemma4CallScan:
    """What scan_call() read of one call's body (the text after `<|tool_call>`)."""

    state: ScanState
    name: str | None = None  # once `call:NAME{` is complete
    arguments: list[tuple[str, Any]] = field(default_factory=list)  # closed top-level pairs, typed
    object_closed: bool = False  # the arguments' `}` seen
    end: int = 0  # complete: index just past `<tool_call|>`


def scan_call(
    text: str, names: Collection[str] | None, parameters: Mapping[str, Any] | None = None
) -> Gemma4CallScan:
    """Read `text` (after `<|tool_call>`). `names`: the known functions (a call to another is invalid),
    None to accept any; `parameters`: each function's parameters schema, to type bare values."""
    scan = Gemma4CallScan("partial")
    try:
        _Reader(text, names, parameters or {}, scan).call()
    except _Partial:
        scan.state = "partial"
    except _Invalid:
        scan.state = "invalid"
    return scan


class _Reader:
    """Recursive descent over one call; raises _Partial at the end of the text, _Invalid on a mismatch."""

    def __init__(
        self, text: str, names: Collection[str] | None, parameters: Mapping[str, Any], scan: Gemma4CallScan
    ):
        self.text, self.pos, self.names, self.parameters, self.scan = text, 0, names, parameters, scan
        self.depth = 0  # objects and lists open: deeper than _MAX_NESTING is no call (not a crash)

    def call(self) -> None:
        self.literal(_HEAD)
        m = _NAME.match(self.text, self.pos)
        if m is None or m.end() == len(self.text):
            self.partial_unless(m is None and self.pos < len(self.text))
        assert m is not None
        name = m.group()
        self.pos = m.end()
        self.literal("{")
        if self.names is not None and name not in self.names:
            raise _Invalid
        self.scan.name = name
        self.pairs(self.parameters.get(name), "}", self.scan.arguments)  # kept as each one closes
        self.scan.object_closed = True
        self.skip_ws()
        self.literal(CALL_CLOSE)
        self.scan.state, self.scan.end = "complete", self.pos

    def pairs(self, schema: Any, close: str, out: list[tuple[str, Any]]) -> None:
        """`key:value` pairs up to `close` (the "{" already read), appended to `out` as each closes;
        a repeated key keeps its first value."""
        properties = _properties(schema)
        self.skip_ws()
        if self.peek_is(close):
            return
        while True:
            key = self.key()
            self.skip_ws()
            self.literal(":")
            self.skip_ws()
            value = self.value(properties.get(key))
            if all(k != key for k, _ in out):
                out.append((key, value))
            self.skip_ws()
            if self.peek_is(","):
                self.skip_ws()
                continue
            self.literal(close)
            return

    def key(self) -> str:
        if self.text.startswith(QUOTE, self.pos) or QUOTE.startswith(self.text[self.pos :]):
            return self.string()
        return self.bare()

    def value(self, schema: Any) -> Any:
        rest = self.text[self.pos : self.pos + len(QUOTE)]
        if not rest:
            raise _Partial
        if rest.startswith(QUOTE) or (rest[0] == "<" and QUOTE.startswith(rest)):
            return self.string()
        if self.text[self.pos] in "{[":
            self.depth += 1
            if self.depth > _MAX_NESTING:
                raise _Invalid
            value = self.container(schema)
            self.depth -= 1
            return value
        return _typed(self.bare(), schema)

    def container(self, schema: Any) -> Any:
        if self.peek_is("{"):
            members: list[tuple[str, Any]] = []
            self.pairs(_object_schema(schema), "}", members)
            return dict(members)
        if self.peek_is("["):
            items: list[Any] = []
            self.skip_ws()
            if self.peek_is("]"):
                return items
            while True:
                items.append(self.value(schema.get("items") if isinstance(schema, dict) else None))
                self.skip_ws()
                if self.peek_is(","):
                    self.skip_ws()
                    continue
                self.literal("]")
                return items
        raise AssertionError("container() is called at a '{' or a '['")

    def string(self) -> str:
        self.literal(QUOTE)
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise _Partial
        value, self.pos = self.text[self.pos : end], end + len(QUOTE)
        return value

    def bare(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _BARE_STOP:
            self.pos += 1
        if self.pos == len(self.text):
            raise _Partial  # a bare token may still grow
        if self.pos == start:
            raise _Invalid
        return self.text[start : self.pos]

    def peek_is(self, char: str) -> bool:
        """Consume `char` if it is next; _Partial at the end of the text."""
        if self.pos >= len(self.text):
            raise _Partial
        if self.text[self.pos] == char:
            self.pos += 1
            return True
        return False

    def literal(self, literal: str) -> None:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return
        self.partial_unless(not literal.startswith(self.text[self.pos :]))

    def partial_unless(self, invalid: bool) -> None:
        raise _Invalid if invalid else _Partial

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1


def _properties(schema: Any) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _object_schema(schema: Any) -> Any:
    return schema if isinstance(schema, dict) and isinstance(schema.get("properties"), dict) else None


def _is_string_only(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    declared = schema.get("type")
    if declared is not None:
        return declared == "string" or declared == ["string"]
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _typed(token: str, schema: Any) -> Any:
    """A bare token as the value it writes (module docstring)."""
    if _is_string_only(schema):
        return token
    if token in _LITERALS:
        return _LITERALS[token]
    if _NUMBER.fullmatch(token):
        return json.loads(token)
    return token


def arguments_prefix(arguments: list[tuple[str, Any]]) -> str:
    """The arguments JSON of these pairs without its closing "}" (json.dumps's layout)."""
    pairs = [
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in arguments
    ]
    return "{" + ", ".join(pairs)


# ---- the forced call's grammar ---------------------------------------------------------------------

# A string after its opening marker, the closing marker included: one token that holds the marker once,
# at its end, so the lexer knows where the text stops (as tools/xml_calls.py's PARAM_TEXT). With the
# marker a special token, the text is a lexeme of its own (it cannot hold a special token).
_STRING_TO_QUOTE = r'/(.|\n)*<\|"\|>/ & ~/(.|\n)*<\|"\|>(.|\n)*<\|"\|>/'
_STRING_TEXT = r'/(.|\n)+/ & ~/(.|\n)*<\|"\|>(.|\n)*/'
_MAX_DEPTH = 8  # nesting followed by schema; deeper values take the generic rule
_GENERIC = """\
gvalue: string | NUMBER | "true" | "false" | "None" | gobject | garray
gobject: "{" (gpair ("," gpair)*)? "}"
gpair: (GKEY | string) ":" gvalue
garray: "[" (gvalue ("," gvalue)*)? "]"
GKEY: /[^,:{}\\[\\]<\\s]+/
NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
INTEGER: /-?(0|[1-9][0-9]*)/
"""


class _GrammarWriter:
    """Lark rules for Gemma 4 values by JSON Schema (gemma4_tool_call_grammar's docstring)."""

    def __init__(self, special_ids: Mapping[str, int]) -> None:
        self.ref = {m: f"<[{special_ids[m]}]>" if m in special_ids else json.dumps(m) for m in MARKERS}
        self.quote_special = QUOTE in special_ids
        self.rules: list[str] = []

    def new_rule(self, body: str) -> str:
        name = f"r_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def literal(self, value: Any) -> str | None:
        """A constant as the template writes it; None for one it writes in a form not pinned here."""
        if isinstance(value, str):
            if self.quote_special:
                text = f" {json.dumps(value)} " if value else " "
                return f"{self.ref[QUOTE]}{text}{self.ref[QUOTE]}"
            return json.dumps(QUOTE + value + QUOTE)
        if isinstance(value, bool):
            return '"true"' if value else '"false"'
        if value is None:
            return '"None"'
        if isinstance(value, (int, float)):
            return json.dumps(str(value))
        return None

    def value(self, schema: Any, depth: int) -> str:
        """A value's expression: its schema's type(s), enum or const; else the generic rule."""
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return "gvalue"
        constants = (
            schema.get("enum") if "enum" in schema else [schema["const"]] if "const" in schema else None
        )
        if isinstance(constants, list) and constants:
            literals = [self.literal(v) for v in constants]
            if all(lit is not None for lit in literals):
                return "(" + " | ".join(literals) + ")"  # type: ignore[arg-type]
            return "gvalue"
        declared = schema.get("type")
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list) or not types:
            branches = schema.get("anyOf") or schema.get("oneOf")
            if isinstance(branches, list) and branches:
                return "(" + " | ".join(self.value(b, depth + 1) for b in branches) + ")"
            return "gvalue"
        return "(" + " | ".join(self.typed(t, schema, depth) for t in types) + ")"

    def typed(self, kind: Any, schema: dict[str, Any], depth: int) -> str:
        if kind == "string":
            return "string"
        if kind == "integer":
            return "INTEGER"
        if kind == "number":
            return "NUMBER"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"None"'
        if kind == "object":
            if not isinstance(schema.get("properties"), dict):
                return "gobject"
            return self.new_rule(f'"{{" {self.members(schema, depth)} "}}"')
        if kind == "array":
            items = (
                self.value(schema["items"], depth + 1) if isinstance(schema.get("items"), dict) else "gvalue"
            )
            return f'"[" ({items} ("," {items})*)? "]"'
        return "gvalue"

    def members(self, schema: dict[str, Any], depth: int) -> str:
        """An object's `key:value` pairs: its properties in the template's order (keys sorted, case
        ignored), each once, the required ones present; no other key."""
        properties = sorted(_properties(schema).items(), key=lambda kv: kv[0].lower())
        required = set(schema.get("required") or ())
        items = [
            (self.new_rule(f"{json.dumps(key + ':')} {self.value(prop, depth + 1)}"), key in required)
            for key, prop in properties
        ]
        alternatives = []
        for k, (first, is_required) in enumerate(items):  # the first pair written is items[k]
            rest = [f'("," {item})' + ("" if req else "?") for item, req in items[k + 1 :]]
            alternatives.append(" ".join([first, *rest]))
            if is_required:
                break
        if not alternatives:
            return ""
        return "(" + " | ".join(alternatives) + ")" + ("" if any(r for _, r in items) else "?")


def gemma4_tool_call_grammar(
    functions: list[tuple[str, dict[str, Any]]],
    *,
    parallel: bool,
    special_ids: Mapping[str, int] | None = None,
) -> str:
    """llguidance Lark grammar for Gemma 4 calls of `functions` ((name, parameters schema) pairs):
    `<|tool_call>call:NAME{` + pairs + `}<tool_call|>`, once or, with `parallel`, one or more back to
    back (as the template writes them). `special_ids`: the markers that are special tokens of this
    tokenizer, with their ids (referenced as tokens, `<[id]>`); the others are text.

    The pairs come in the template's order, the properties' keys sorted ignoring case (dictsort), each
    once; a required one must be there, no key the schema does not name (objects are closed, as the
    other formats' grammars close them). A value follows its schema: a string is `<|"|>` free text
    without `<|"|>` `<|"|>` (or one of its enum values), an integer or a number its digits, a boolean
    true/false, null None, an object with properties its pairs the same way (recursively, up to
    _MAX_DEPTH), an array its items; a type list, anyOf and oneOf are alternatives. Anything the
    schema does not pin down (no type, an object without properties, non-scalar constants) takes the
    generic rule, any Gemma 4 value (`gvalue`), not %json: the syntax is not JSON."""
    writer = _GrammarWriter(special_ids or {})
    heads = []
    for name, schema in functions:
        members = writer.members(schema, 0)
        head = json.dumps(f"call:{name}{{")
        heads.append(
            writer.new_rule(f'{writer.ref[CALL_OPEN]} {head} {members} "}}" {writer.ref[CALL_CLOSE]}')
        )
    if writer.quote_special:
        string = f"string: {writer.ref[QUOTE]} STRING_TEXT? {writer.ref[QUOTE]}\nSTRING_TEXT: {_STRING_TEXT}"
    else:
        string = f"string: {json.dumps(QUOTE)} STRING_TO_QUOTE\nSTRING_TO_QUOTE: {_STRING_TO_QUOTE}"
    lines = [
        "start: call+" if parallel else "start: call",
        "call: " + " | ".join(heads),
        *writer.rules,
        string,
        _GENERIC,
    ]
    return "\n".join(lines)


# ---- the history's tool results ------------------------------------------------------------------------


def tool_responses_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the template reads tool results. The template renders a model turn as its
    calls, then their results (`<|tool_response>response:NAME{...}<tool_response|>`, from the
    message's `tool_responses`), then its text, and leaves the turn open after results with no text
    (the model answers in the same turn); an OpenAI `tool` message it would render as a turn of role
    "tool", which Gemma 4 has no such thing as. So each run of `tool` messages right after an assistant
    message with tool_calls becomes that message's tool_responses, each {"name", "response"}: the name
    is the message's `name`, else its tool_call_id's call's; the content is decoded when it is JSON (an
    object is rendered key by key, anything else as `value:`), else kept as the text. An assistant
    message without calls right after the results continues that turn: its content becomes the calling
    message's (when that had none; its other fields are not carried over). Other messages are kept,
    and a `tool` message with no call before it stays as it is. The input is not modified."""
    out: list[dict[str, Any]] = []
    for message in messages:
        prev = out[-1] if out else None
        role = message.get("role")
        if role == "tool" and prev is not None and prev.get("role") == "assistant" and prev.get("tool_calls"):
            prev["tool_responses"] = [*(prev.get("tool_responses") or ()), _tool_response(message, prev)]
        elif (
            role == "assistant"
            and not message.get("tool_calls")
            and prev is not None
            and prev.get("tool_responses")
            and not prev.get("content")
        ):
            prev["content"] = message.get("content")
        else:
            out.append(dict(message))
    return out


def _tool_response(message: dict[str, Any], caller: dict[str, Any]) -> dict[str, Any]:
    name = message.get("name")
    if not isinstance(name, str) or not name:
        calls = [
            c
            for c in caller["tool_calls"]
            if isinstance(c, dict) and c.get("id") == message.get("tool_call_id")
        ]
        function = calls[0].get("function") if calls else None
        name = function.get("name") if isinstance(function, dict) else None
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    response: Any = content if content is not None else ""
    if isinstance(response, str):
        with contextlib.suppress(ValueError):  # not JSON: the text as sent
            response = json.loads(response)
    return {"name": name or "unknown", "response": response}
