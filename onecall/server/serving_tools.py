"""Tools and reasoning in a chat request: what the template renders, what a grammar enforces, and
the per-choice parser that splits the output into reasoning_content, content and tool_calls.

ChatTools, from the request (validate_tools: a 400 naming the field for tools: [], tool_choice
without tools, a named function not in tools, non-object parameters, a bad name):

    format    the template renders                        enforcement ("required", a named function)
    hermes    the tools, tool_calls and tool messages      a Lark grammar: <tool_call> blocks
              itself (Qwen2.5, Qwen3)
    json      no tools: tools_system_prompt() goes into     a JSON Schema: {"tool_calls": [...]}
              the system message, assistant tool_calls
              become the convention's JSON (SmolLM2)

    tool_choice "none"       tools not offered (not rendered, output not parsed); a history with
                             calls still renders
    "auto"                   the output is parsed (ToolCallParser); calls -> message.tool_calls
    "required" / a function  a grammar makes the call parse and its arguments validate
    parallel_tool_calls      false: one call at most (the grammar's maxItems, or the first parsed)

ChoiceParser, one per choice: reasoning first (a thinking template's <think> block ->
reasoning_content), then tool calls in what remains. feed()/finish() stream it; whole() parses a
response. Its tool-call pieces become OpenAI deltas: id, type and name once, then the arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from onecall.sampling_params import StructuredOutputsParams
from onecall.server.protocol import ChatCompletionRequest
from onecall.server.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from onecall.text.reasoning import ReasoningDelta, ReasoningFormat, ReasoningParser
from onecall.text.tokenizer import Tokenizer
from onecall.text.tool_calls import ToolCallDelta, ToolCallParser
from onecall.text.tool_specs import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolChoice,
    ToolFormat,
    messages_for_json_tools,
    tool_call_grammar,
    tool_call_schema,
    validate_tools,
)


@dataclass(frozen=True)
class ChatTools:
    """A chat request's validated tools, for one model's template."""

    choice: ToolChoice
    format: ToolFormat
    tools: list[dict[str, Any]] | None  # as sent; None when none are offered (tool_choice "none")
    parallel: bool
    special_markers: bool  # hermes: <tool_call> is a special token of this tokenizer

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, tokenizer: Tokenizer) -> ChatTools:
        choice = validate_tools(req.tools, req.tool_choice)
        fmt = ToolFormat.for_template(tokenizer.chat_template)
        return cls(
            choice=choice,
            format=fmt,
            tools=req.tools if choice.mode != "none" else None,
            parallel=req.parallel_tool_calls is not False,
            special_markers=fmt == ToolFormat.HERMES and is_special(tokenizer, TOOL_CALL_OPEN),
        )

    def template_inputs(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for render_chat."""
        if self.format == ToolFormat.HERMES:
            return messages, self.tools
        return messages_for_json_tools(messages, self.tools), None

    def enforced(self) -> StructuredOutputsParams | None:
        """The constraint that makes a "required" or named call always parse; None otherwise."""
        if self.choice.mode != "required":
            return None
        assert self.tools is not None, "validate_tools gives mode 'required' only with tools"
        name = self.choice.name
        if self.format == ToolFormat.JSON:
            return StructuredOutputsParams(
                json=tool_call_schema(self.tools, required_name=name, parallel=self.parallel)
            )
        grammar = tool_call_grammar(
            self.tools, required_name=name, parallel=self.parallel, special_markers=self.special_markers
        )
        return StructuredOutputsParams(grammar=grammar)

    def new_parser(self) -> ToolCallParser | None:
        if self.tools is None:
            return None
        return ToolCallParser(self.format, tool_names=[f.name for f in self.choice.functions])


def is_special(tokenizer: Tokenizer, text: str) -> bool:
    """Is `text` one special token (dropped from the output text unless skip_special_tokens=False)?"""
    ids = tokenizer.encode(text)
    return len(ids) == 1 and ids[0] in tokenizer.special_ids


def markers_are_special(tokenizer: Tokenizer, tools: ChatTools, reasoning: ReasoningFormat | None) -> bool:
    """Must the output text keep special tokens for the parsers to see their markers?"""
    markers = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE] if tools.tools is not None and tools.special_markers else []
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
        calls = [c for p in parts for c in p.tool_calls]
        if self._max_calls is not None:  # parallel_tool_calls false: the first call only
            calls = [c for c in calls if c.index < self._max_calls]
        self.num_calls = max([self.num_calls, *(c.index + 1 for c in calls)])
        return ChoiceDelta(r.reasoning, "".join(p.content for p in parts), [wire_delta(c) for c in calls])


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
