"""Tool calls out of model output: whole-text and streaming parsers (tools themselves: tools/specs.py).

Four formats, chosen per model by ToolFormat.for_template():

    hermes   the template renders tools itself and the model answers (Qwen2.5, Qwen3)
                 I'll check.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
             several calls are several blocks; text before them is content.
    json     the template knows no tools (the embedded SmolLM2): the server merges tools_system_prompt()
             into the system message, and the model answers with one JSON object and nothing else
                 {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
             optionally inside a ``` or ```json fence. Only output that starts with the object counts;
             a bare call object {"name": ..., "arguments": ...} is accepted too.
    xml      Qwen3.5's template (Qwen3-Coder's layout), calls as tags in <tool_call> blocks
                 <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>...
             each value typed by the function's schema (tools/xml_calls.py); text before them is content.
    gemma4   Gemma 4's template, calls in its own key:value syntax, strings between <|"|> markers
                 <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
             values typed as written (tools/gemma4_calls.py); text before, between and after is content.

A call is valid when its JSON parses, "name" is a non-empty string (one of the tools, when the parser
knows them) and "arguments" (or "parameters") is an object or a string holding one; missing arguments
are {}; an xml or gemma4 call is valid when it scans (scan_call in tools/xml_calls.py or
tools/gemma4_calls.py) and names one of the tools.
An invalid call stays in the content as the text it was: parsing never raises.

ToolCallParser streams: a call goes out, as (index, id, name) then its arguments, once it is complete
and validated (at `</tool_call>`, or when the JSON object closes); text that may still become a call
is held back until decided. With stream_arguments (grammar-constrained output: tool_choice "required"
or a named function, whose calls cannot fail to validate) each call's head goes out as soon as its
name is written and its raw arguments as they are generated (_ArgumentStreamer; xml, gemma4: a parameter at a
time, as each "</parameter>" arrives, typed as the whole call's JSON will be); a call that max_tokens
cuts short then stays partial, with finish_reason "length", as OpenAI's streams do. Content is the text outside calls, stripped at both ends (None when
empty). Invariant: the concatenation of everything streamed equals parse_tool_calls(whole text), which
is implemented by feeding the text in one piece.

Enforcement (tool_choice "required" or a named function) uses tool_call_schema() (json format) or
tool_call_grammar() (hermes, llguidance's Lark dialect with an inline %json schema). Both pin the JSON
layout to json.dumps's separators (", " and ": ", no other whitespace), what the models were shown.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from onecall.text.reasoning import StrippedStream, partial_marker_len
from onecall.tools import gemma4_calls
from onecall.tools.specs import TOOL_CALL_CLOSE as _CLOSE
from onecall.tools.specs import TOOL_CALL_OPEN as _OPEN
from onecall.tools.specs import ToolFormat
from onecall.tools.xml_calls import arguments_prefix, scan_call

_ID_ALPHABET = string.ascii_letters + string.digits
_FENCE = "```"
_JSON_OPENING = re.compile(r"\s*(?:```(?:json)?\s*)?\{")  # where the json convention's object starts
_PARTIAL_OPENING = re.compile(r"```(?:json)?\s*")  # a fence still waiting for its "{"


@dataclass(frozen=True)
class ToolCall:
    """A parsed call, OpenAI-shaped: arguments_json is a JSON object as a string."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: first id+name (arguments ""), then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolParseDelta:
    """What one feed adds: content text and call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None  # None when the output was only calls (or empty)
    tool_calls: list[ToolCall]


def new_tool_call_id() -> str:
    """'call_' + 24 random letters and digits (OpenAI clients want at least 9 characters)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# ---- parsing ---------------------------------------------------------------------------------------


def _call_from_obj(obj: Any, names: Collection[str] | None) -> tuple[str, str] | None:
    """(name, arguments_json) from a decoded call object, or None if it is not a valid call."""
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _calls_from_convention(obj: Any, names: Collection[str] | None) -> list[tuple[str, str]] | None:
    """The json convention's {"tool_calls": [...]} (or one bare call object); None unless all valid."""
    items = obj.get("tool_calls") if isinstance(obj, dict) and "tool_calls" in obj else [obj]
    if not isinstance(items, list) or not items:
        return None
    calls = [_call_from_obj(item, names) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class ToolCallParser:
    """Incremental tool-call parser: feed(delta) -> ToolParseDelta for each text delta, then finish().

    hermes states:  OUTSIDE --<tool_call>--> INSIDE --</tool_call>: a call, or its text as content--> OUTSIDE
    json states:    START --the object opens--> OBJECT --it closes: calls, or its text as content--> AFTER
                    START/AFTER --anything else--> TEXT (plain content to the end)
    `_buf` holds the undecided text; the marker, fence or object it may still become.
    """

    def __init__(
        self,
        fmt: ToolFormat,
        *,
        tool_names: Collection[str] | None = None,
        new_id: Callable[[], str] = new_tool_call_id,
        stream_arguments: bool = False,
        tool_parameters: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self.fmt = fmt
        # stream_arguments: only for grammar-constrained output (tool_choice "required" or a named
        # function), where every call is guaranteed to complete and validate unless max_tokens cuts
        # it: each call's head goes out as soon as its name is written and its arguments as they are
        # generated (raw, as the grammar pinned them). Without a grammar ("auto") a call is held
        # until it is complete and validated, because text that looks like a call may still turn
        # out not to be one (a wrong name, bad JSON, prose after it), and a streamed piece cannot
        # be taken back.
        # xml, gemma4: calls scanned structurally (_scan_xml), their markers per format
        is_xml = fmt in (ToolFormat.XML, ToolFormat.GEMMA4)
        self._open, self._close = (
            (gemma4_calls.CALL_OPEN, gemma4_calls.CALL_CLOSE) if fmt == ToolFormat.GEMMA4 else (_OPEN, _CLOSE)
        )
        self._streamer = _ArgumentStreamer(new_id) if stream_arguments and not is_xml else None
        self._stream_xml = stream_arguments and is_xml  # xml: parameter by parameter (_advance_xml)
        self._xml_head: str | None = None  # xml: the id of the call whose head went out, if any
        self._xml_sent = 0  # xml: characters of that call's arguments sent
        # xml: each function's parameters schema, to type its values (tools/xml_calls.py)
        self._parameters = tool_parameters or {}
        if tool_names is None and tool_parameters is not None:
            tool_names = list(tool_parameters)
        self._names = tool_names  # when given, a call to another name is not a call
        self._new_id = new_id
        self._state = "start" if fmt == ToolFormat.JSON else "outside"
        self._buf = ""
        self._content = StrippedStream()
        self._num_calls = 0
        self._obj_start = 0  # json: where the object starts in _buf (after whitespace and a fence)
        self._out = ToolParseDelta()

    def feed(self, delta: str) -> ToolParseDelta:
        self._buf += delta
        if self._streamer is not None:
            self._streamer.push(delta)
        if self.fmt == ToolFormat.HERMES:
            self._scan_hermes()
        elif self.fmt in (ToolFormat.XML, ToolFormat.GEMMA4):
            self._scan_xml()
        else:
            self._scan_json(may_close="}" in delta)
        if self._streamer is not None:
            self._out.tool_calls += self._streamer.pieces(self._num_calls)
        return self._take()

    def finish(self) -> ToolParseDelta:
        """End of output: an unclosed <tool_call> still counts if its JSON is a valid call; else it was
        a call cut short (max_tokens), which is not content: its markup and JSON are dropped (under a
        grammar its head and arguments so far already went out, a partial call). Any other undecided
        text is content."""
        text, self._buf = self._buf, ""
        if self._state == "inside" and self.fmt in (ToolFormat.XML, ToolFormat.GEMMA4):
            body = self._scan_body(text)
            if body.closed and body.name is not None and body.state != "invalid":
                self._emit_xml_call(body.name, body.arguments)  # all but its "</tool_call>"
            elif self.fmt == ToolFormat.GEMMA4 and self._close in text and self._xml_head is None:
                # gemma4: a string left open (it may hold "<tool_call|>"), then the output ended: the
                # block did close, so it was not cut short, and its text is content
                self._emit_content(self._open + text)
            return self._take()
        if self._state == "inside":
            call = _call_from_json(text, self._names)
            if call is not None:
                self._emit_call(*call)
            return self._take()
        self._emit_content(text)
        return self._take()

    def _take(self) -> ToolParseDelta:
        out, self._out = self._out, ToolParseDelta()
        return out

    def _emit_content(self, text: str) -> None:
        self._out.content += self._content.push(text)

    def _emit_call(self, name: str, arguments_json: str) -> None:
        index, self._num_calls = self._num_calls, self._num_calls + 1
        if self._streamer is not None:
            rest = self._streamer.complete(index, name)
            if rest is not None:  # the head and the arguments went out as they were generated
                self._out.tool_calls += rest
                return
        self._out.tool_calls.append(ToolCallDelta(index, id=self._new_id(), name=name))
        self._out.tool_calls.append(ToolCallDelta(index, arguments=arguments_json))

    def _scan_outside(self) -> bool:
        """Content up to the next "<tool_call>" (then INSIDE: True), or up to what may start one."""
        start = self._buf.find(self._open)
        if start < 0:  # hold back what may be the start of "<tool_call>"
            cut = len(self._buf) - partial_marker_len(self._buf, self._open)
            self._emit_content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        self._emit_content(self._buf[:start])
        self._buf, self._state = self._buf[start + len(self._open) :], "inside"
        return True

    def _scan_body(self, text: str) -> _Body:
        """xml, gemma4: one call's body (after its opening marker) as far as it goes."""
        if self.fmt == ToolFormat.GEMMA4:
            g = gemma4_calls.scan_call(text, self._names, self._parameters)
            arguments = gemma4_calls.arguments_prefix(g.arguments)
            return _Body(g.state, g.name, arguments, g.object_closed, g.end)
        x = scan_call(text, _CLOSE, self._names)
        schema = self._parameters.get(x.name) if x.name is not None else None
        return _Body(x.state, x.name, arguments_prefix(x.parameters, schema), x.function_closed, x.end)

    def _scan_xml(self) -> None:
        """xml, gemma4: INSIDE is decided by scanning the call's structure (a value may hold the
        closing marker): complete -> a call; a prefix of one -> wait (streaming what a grammar
        guarantees); cannot become one -> its text up to the closing marker is content (held until
        that marker comes)."""
        while True:
            if self._state == "outside" and not self._scan_outside():
                return
            body = self._scan_body(self._buf)
            if body.state == "partial":
                if self._stream_xml and body.name is not None:
                    self._advance_xml(body.name, body.arguments)
                return
            if body.state == "complete":
                self._emit_xml_call(body.name or "", body.arguments)
                self._buf, self._state = self._buf[body.end :], "outside"
                continue
            end = self._buf.find(self._close)
            if end < 0:
                return
            if self._xml_head is not None:  # a streamed head, then text no grammar allowed: left partial
                self._num_calls, self._xml_head, self._xml_sent = self._num_calls + 1, None, 0
            self._emit_content(self._open + self._buf[: end + len(self._close)])
            self._buf, self._state = self._buf[end + len(self._close) :], "outside"

    def _advance_xml(self, name: str, prefix: str, *, close: bool = False) -> None:
        """Send what is new of the current xml/gemma4 call: its head once, then its arguments pair by
        pair (`prefix`: its arguments JSON so far, without the closing brace)."""
        index = self._num_calls
        if self._xml_head is None:
            self._xml_head = self._new_id()
            self._out.tool_calls.append(ToolCallDelta(index, id=self._xml_head, name=name))
        arguments = prefix + ("}" if close else "")
        if len(arguments) > self._xml_sent:
            self._out.tool_calls.append(ToolCallDelta(index, arguments=arguments[self._xml_sent :]))
        self._xml_sent = len(arguments)

    def _emit_xml_call(self, name: str, prefix: str) -> None:
        self._advance_xml(name, prefix, close=True)
        self._num_calls, self._xml_head, self._xml_sent = self._num_calls + 1, None, 0

    def _scan_hermes(self) -> None:
        while True:
            if self._state == "outside":
                if not self._scan_outside():
                    return
            else:  # inside: the whole body is held until "</tool_call>" decides it
                end = self._buf.find(_CLOSE)
                if end < 0:
                    return
                body, self._buf, self._state = self._buf[:end], self._buf[end + len(_CLOSE) :], "outside"
                call = _call_from_json(body, self._names)
                if call is not None:
                    self._emit_call(*call)
                else:
                    self._emit_content(_OPEN + body + _CLOSE)

    def _scan_json(self, may_close: bool) -> None:
        """One pass over START -> OBJECT -> AFTER -> TEXT; each state returns while it must wait."""
        if self._state == "start":
            opening = _JSON_OPENING.match(self._buf)
            stripped = self._buf.lstrip()
            if opening is None and ("```json".startswith(stripped) or _PARTIAL_OPENING.fullmatch(stripped)):
                return  # may still become "```json\n{"
            self._state = "text" if opening is None else "object"
            self._obj_start = opening.end() - 1 if opening else 0
            may_close = True
        if self._state == "object":
            if not may_close:
                return  # the object can only close on a "}" (and json's raw_decode needs the whole of it)
            try:
                obj, end = json.JSONDecoder().raw_decode(self._buf, self._obj_start)
            except ValueError:
                return
            calls = _calls_from_convention(obj, self._names)
            if calls is None:  # valid JSON, not calls: all of it (fence included) is content
                self._state = "text"
            else:
                for call in calls:
                    self._emit_call(*call)
                self._buf, self._state = self._buf[end:], "after"
        if self._state == "after":  # drop a closing fence; the rest is content
            stripped = self._buf.lstrip()
            if stripped.startswith(_FENCE):
                self._buf, self._state = stripped[len(_FENCE) :], "text"
            elif _FENCE.startswith(stripped):
                return
            else:
                self._state = "text"
        if self._state == "text":
            self._emit_content(self._buf)
            self._buf = ""


@dataclass(frozen=True)
class _Body:
    """One xml or gemma4 call's body as scanned so far (tools/xml_calls.py, tools/gemma4_calls.py)."""

    state: str  # complete, partial, invalid
    name: str | None
    arguments: str  # the arguments JSON of the pairs closed so far, without its closing "}"
    closed: bool  # the function (xml) or the arguments object (gemma4) has closed
    end: int  # complete: index just past the closing marker


_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": \{')  # the grammar's pinned layout


class _ArgumentStreamer:
    """Streams grammar-constrained calls as they are generated: the whole output so far is scanned
    for call heads in the pinned layout (`{"name": "N", "arguments": {`), and each call's arguments
    object is followed, string- and escape-aware, to its closing brace. Pieces already sent are
    remembered per call, so every feed sends only what is new. Invariant: for call i, the arguments
    sent are a prefix of the raw arguments text, and complete() sends the rest exactly once."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._text = ""
        self._names: dict[int, str] = {}
        self._heads: dict[int, tuple[str, str]] = {}  # index -> (id, name) of calls whose head went out
        self._sent: dict[int, int] = {}  # index -> characters of its arguments sent
        self._args: dict[int, tuple[str, bool]] = {}  # index -> (raw arguments so far, complete)

    def push(self, delta: str) -> None:
        self._text += delta
        self._scan()

    def pieces(self, num_done: int) -> list[ToolCallDelta]:
        """What is new of the calls the parser has not finished yet (index >= num_done)."""
        out: list[ToolCallDelta] = []
        for index, (args, _) in self._args.items():
            if index < num_done:
                continue  # the parser already finished this call through complete()
            if index not in self._heads:
                self._heads[index] = (self._new_id(), self._names[index])
                out.append(ToolCallDelta(index, id=self._heads[index][0], name=self._names[index]))
            sent = self._sent.get(index, 0)
            if len(args) > sent:
                out.append(ToolCallDelta(index, arguments=args[sent:]))
                self._sent[index] = len(args)
        return out

    def complete(self, index: int, name: str) -> list[ToolCallDelta] | None:
        """The parser validated call `index`: what is left of it to send; None when this streamer
        did not see the call in the pinned layout (then the parser sends it whole, as before)."""
        args = self._args.get(index)
        if args is None or not args[1] or self._names.get(index) != name:
            return None
        out: list[ToolCallDelta] = []
        if index not in self._heads:
            self._heads[index] = (self._new_id(), name)
            out.append(ToolCallDelta(index, id=self._heads[index][0], name=name))
        sent = self._sent.get(index, 0)
        if len(args[0]) > sent:
            out.append(ToolCallDelta(index, arguments=args[0][sent:]))
        self._sent[index] = len(args[0])
        return out

    def _scan(self) -> None:
        """Re-derive every call's (name, raw arguments so far, complete) from the text so far. A rescan
        per feed is quadratic in the output's length; tool calls are a few hundred characters, and a
        derivation from scratch cannot drift from the text the way incremental state could."""
        self._names, self._args = {}, {}
        pos, index = 0, 0
        while (m := _HEAD.search(self._text, pos)) is not None:
            start = m.end() - 1  # the arguments' "{"
            end = _object_end(self._text, start)
            self._names[index] = m.group(1)
            self._args[index] = (
                self._text[start : end if end is not None else len(self._text)],
                end is not None,
            )
            if end is None:
                return
            pos, index = end, index + 1


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object opening at text[start] ("{"), or None if it has not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _call_from_json(text: str, names: Collection[str] | None) -> tuple[str, str] | None:
    try:
        return _call_from_obj(json.loads(text), names)
    except ValueError:
        return None


def parse_tool_calls(
    text: str,
    fmt: ToolFormat,
    *,
    tool_names: Collection[str] | None = None,
    new_id: Callable[[], str] = new_tool_call_id,
    tool_parameters: Mapping[str, dict[str, Any]] | None = None,
) -> ParsedToolCalls:
    """Whole output -> content (None if only calls) and the calls, exactly what streaming would give."""
    parser = ToolCallParser(fmt, tool_names=tool_names, new_id=new_id, tool_parameters=tool_parameters)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    return ParsedToolCalls(content or None, assemble_tool_calls(d for d in deltas))


def assemble_tool_calls(deltas: Iterable[ToolParseDelta]) -> list[ToolCall]:
    """Assemble streamed call pieces the way an OpenAI client does (id and name once, arguments joined)."""
    heads: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.id is not None and piece.name is not None:
                heads[piece.index] = (piece.id, piece.name)
            args[piece.index] = args.get(piece.index, "") + piece.arguments
    return [ToolCall(heads[i][0], heads[i][1], args[i]) for i in sorted(heads)]
