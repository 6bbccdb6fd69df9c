"""Tools and reasoning in a chat request: what the template renders, what a grammar enforces, and
the per-choice parser that splits the output into reasoning_content, content and tool_calls.

ChatTools (the tools for one model's template, their grammar and parser) is the library's
(tools/calling.py, what LLM.chat uses too); chat_tools() builds it from a request.

ChoiceParser, one per choice: reasoning first (a thinking template's <think> block ->
reasoning_content), then tool calls in what remains. feed()/finish() stream it; whole() parses a
response. Its tool-call pieces become OpenAI deltas: id, type and name once, then the arguments.

HarmonyChoiceParser does the same for a gpt-oss model (text/harmony.py), from the output's token ids
rather than its text: analysis -> reasoning_content, final -> content, calls to functions.NAME ->
tool_calls. feed_tokens()/finish() stream it; whole_tokens() parses a response.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from onecall.server.protocol import ChatCompletionRequest
from onecall.server.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from onecall.text.harmony import HarmonyDelta, HarmonyStream
from onecall.text.reasoning import ReasoningDelta, ReasoningFormat, ReasoningParser
from onecall.text.tokenizer import Tokenizer
from onecall.tools.calling import ChatTools, is_special
from onecall.tools.calls import ToolCallDelta, ToolCallParser


def chat_tools(req: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatTools:
    """The request's validated tools (the shared implementation: tools/calling.py)."""
    return ChatTools.build(req.tools, req.tool_choice, tokenizer, parallel_tool_calls=req.parallel_tool_calls)


def markers_are_special(tokenizer: Tokenizer, tools: ChatTools, reasoning: ReasoningFormat | None) -> bool:
    """Must the output text keep special tokens for the parsers to see their markers?"""
    markers = list(tools.markers) if tools.tools is not None and tools.special_markers else []
    markers += [reasoning.start, reasoning.end] if reasoning is not None else []
    return any(is_special(tokenizer, m) for m in markers)


@dataclass
class ChoiceDelta:
    """What one feed of a choice's text adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedChoice:
    reasoning_content: str | None
    content: str | None  # None when empty (only reasoning or calls)
    tool_calls: list[ToolCall]


class ChoiceParser:
    """One choice's output -> reasoning, content and tool calls, streamed or whole."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, *, max_calls: int | None
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self.num_calls = 0
        self._held: list[ToolCallDelta] = []  # argument fragments held for the next chunk (see _split)

    def feed(self, text: str) -> ChoiceDelta:
        r = self._reasoning.feed(text) if self._reasoning is not None else ReasoningDelta("", text)
        return self._split(r, is_last=False)

    def finish(self) -> ChoiceDelta:
        r = self._reasoning.finish() if self._reasoning is not None else ReasoningDelta("", "")
        return self._split(r, is_last=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """ "tool_calls" when the output ended with calls, else the engine's reason."""
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason

    def whole(self, text: str) -> ParsedChoice:
        deltas = [self.feed(text), self.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        return ParsedChoice(
            reasoning_content=reasoning or None,
            content=content or None,
            tool_calls=assemble(d.tool_calls for d in deltas),
        )

    def _split(self, r: ReasoningDelta, *, is_last: bool) -> ChoiceDelta:
        if self._tools is None:
            return ChoiceDelta(r.reasoning, r.content)
        parts = [self._tools.feed(r.content)] if r.content else []
        if is_last:
            parts.append(self._tools.finish())
        calls = self._held + [c for p in parts for c in p.tool_calls]
        if self._max_calls is not None:  # parallel_tool_calls false: the first call only
            calls = [c for c in calls if c.index < self._max_calls]
        self.num_calls = max([self.num_calls, *(c.index + 1 for c in calls)])
        calls, self._held = one_entry_per_call(calls, hold=not is_last)
        return ChoiceDelta(r.reasoning, "".join(p.content for p in parts), [wire_delta(c) for c in calls])


class HarmonyChoiceParser:
    """One choice of a gpt-oss model: its token ids -> reasoning, content and tool calls."""

    def __init__(self, *, max_calls: int | None) -> None:
        self._stream = HarmonyStream()
        self._max_calls = max_calls
        self.num_calls = 0
        self._held: list[ToolCallDelta] = []

    def feed_tokens(self, token_ids: list[int]) -> ChoiceDelta:
        return self._split(self._stream.feed(token_ids), is_last=False)

    def finish(self) -> ChoiceDelta:
        return self._split(self._stream.finish(), is_last=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """ "tool_calls" when the output ended with calls (<|call|> is a stop token), else the engine's."""
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason

    def whole_tokens(self, token_ids: list[int]) -> ParsedChoice:
        deltas = [self.feed_tokens(token_ids), self.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        return ParsedChoice(
            reasoning_content=reasoning or None,
            content=content or None,
            tool_calls=assemble(d.tool_calls for d in deltas),
        )

    def _split(self, d: HarmonyDelta, *, is_last: bool) -> ChoiceDelta:
        calls = self._held + [ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in d.calls]
        if self._max_calls is not None:  # parallel_tool_calls false: the first call only
            calls = [c for c in calls if c.index < self._max_calls]
        self.num_calls = max([self.num_calls, *(c.index + 1 for c in calls)])
        calls, self._held = one_entry_per_call(calls, hold=not is_last)
        return ChoiceDelta(d.reasoning, d.content, [wire_delta(c) for c in calls])


AnyChoiceParser = ChoiceParser | HarmonyChoiceParser


def one_entry_per_call(
    pieces: list[ToolCallDelta], hold: bool
) -> tuple[list[ToolCallDelta], list[ToolCallDelta]]:
    """A chunk's call pieces as OpenAI sends them, one entry per call: (this chunk's, held for the
    next). A call's head goes out alone (arguments "") and the fragments after it in this chunk wait
    for the next (`hold`; the last chunk joins them to it); fragments of one call are joined. Two
    entries with one index in a chunk made the openai library's stream accumulator, in the versions
    instructor pins, split the call in two."""
    out: list[ToolCallDelta] = []
    held: list[ToolCallDelta] = []
    headed: set[int] = set()  # calls whose head is in this chunk
    for piece in pieces:
        if piece.id is not None:
            headed.add(piece.index)
        elif piece.index in headed and hold:
            _join(held, piece)
            continue
        _join(out, piece)
    return out, held


def _join(pieces: list[ToolCallDelta], piece: ToolCallDelta) -> None:
    if pieces and pieces[-1].index == piece.index and piece.id is None:
        last = pieces[-1]
        pieces[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + piece.arguments)
    else:
        pieces.append(piece)


def wire_delta(piece: ToolCallDelta) -> DeltaToolCall:
    """A call's first piece carries its id, type and name (arguments ""), later ones the arguments."""
    if piece.id is not None:
        return DeltaToolCall(
            index=piece.index,
            id=piece.id,
            type="function",
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
        )
    return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))


def assemble(delta_lists: Iterable[list[DeltaToolCall]]) -> list[ToolCall]:
    """Whole calls from streamed pieces, as an OpenAI client assembles them (name once, arguments joined)."""
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, str] = {}
    for deltas in delta_lists:
        for d in deltas:
            if d.id is not None and d.function is not None and d.function.name is not None:
                heads[d.index] = (d.id, d.function.name)
            args = d.function.arguments if d.function is not None else None
            arguments[d.index] = arguments.get(d.index, "") + (args or "")
    return [
        ToolCall(id=heads[i][0], function=FunctionCall(name=heads[i][1], arguments=arguments[i]))
        for i in sorted(heads)
    ]
