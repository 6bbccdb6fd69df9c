"""Tool calling, the one implementation the server and the library (LLM.chat) share.

ChatTools holds a request's validated tools for one model's template (a typed 400-style
InvalidParameterError, naming the field, for tools: [], tool_choice without tools, a named function
not in tools, non-object parameters, a bad name):

    format    the template renders                        enforcement ("required", a named function)
    hermes    the tools, tool_calls and tool messages      a Lark grammar: <tool_call> blocks
              itself (Qwen2.5, Qwen3)
    xml       as hermes, calls as <function=...> tags      a Lark grammar: <function=...> blocks,
              (Qwen3.5; tools/xml_calls.py)                 values typed by the parameters' schemas
    gemma4    as hermes, calls as <|tool_call>call:NAME{}   a Lark grammar: Gemma 4's key:value
              blocks; `tool` messages become the calling    syntax by the parameters' schemas
              message's tool_responses (tools/gemma4_calls.py)
    json      no tools: tools_system_prompt() goes into     a JSON Schema: {"tool_calls": [...]}
              the system message, assistant tool_calls
              become the convention's JSON (SmolLM2)

    tool_choice "none"       tools not offered (not rendered, output not parsed); a history with
                             calls still renders
    "auto"                   the output is parsed (ToolCallParser); calls -> tool_calls
    "required" / a function  a grammar makes the call parse and its arguments validate
    parallel_tool_calls      false: one call at most (the grammar's maxItems, or the first parsed)

ToolChatOutput is what LLM.chat returns when tools are given: the engine's output plus the parsed
content, calls and the API's finish_reason ("tool_calls" when the output ended with calls).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onecall.errors import InvalidParameterError
from onecall.sampling_params import SamplingParams, StructuredOutputsParams
from onecall.text.tokenizer import Tokenizer
from onecall.tools import gemma4_calls
from onecall.tools.calls import ToolCall, ToolCallParser, assemble_tool_calls
from onecall.tools.specs import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolChoice,
    ToolFormat,
    messages_for_json_tools,
    tool_call_grammar,
    tool_call_schema,
    validate_tools,
)
from onecall.tools.xml_calls import xml_tool_call_grammar

if TYPE_CHECKING:
    from onecall.engine.engine import RequestOutput


def is_special(tokenizer: Tokenizer, text: str) -> bool:
    """Is `text` one special token (dropped from the output text unless skip_special_tokens=False)?"""
    ids = tokenizer.encode(text)
    return len(ids) == 1 and ids[0] in tokenizer.special_ids


@dataclass(frozen=True)
class ChatTools:
    """A chat request's validated tools, for one model's template."""

    choice: ToolChoice
    format: ToolFormat
    tools: list[dict[str, Any]] | None  # as sent; None when none are offered (tool_choice "none")
    parallel: bool
    special_markers: bool  # hermes, xml: <tool_call> is a special token; gemma4: one of its markers is
    # gemma4: the markers that are special tokens of this tokenizer, with their ids (the grammar names
    # them as tokens); the others are text
    special_ids: tuple[tuple[str, int], ...] = ()

    @classmethod
    def build(
        cls, tools: Any, tool_choice: Any, tokenizer: Tokenizer, *, parallel_tool_calls: bool | None = None
    ) -> ChatTools:
        """Validate OpenAI's `tools` / `tool_choice` (typed errors naming the field) for this tokenizer."""
        choice = validate_tools(tools, tool_choice)
        fmt = ToolFormat.for_template(tokenizer.chat_template)
        special_ids: tuple[tuple[str, int], ...] = ()
        if fmt == ToolFormat.GEMMA4:  # each marker may be special or text (GGUF files keep them text)
            special_ids = tuple(
                (m, tokenizer.encode(m)[0]) for m in gemma4_calls.MARKERS if is_special(tokenizer, m)
            )
        return cls(
            choice=choice,
            format=fmt,
            tools=tools if choice.mode != "none" else None,
            parallel=parallel_tool_calls is not False,
            special_markers=bool(special_ids)
            if fmt == ToolFormat.GEMMA4
            else fmt != ToolFormat.JSON and is_special(tokenizer, TOOL_CALL_OPEN),
            special_ids=special_ids,
        )

    @property
    def markers(self) -> tuple[str, ...]:
        """The text markers of this format's calls (those the output text must keep)."""
        if self.format == ToolFormat.GEMMA4:
            return gemma4_calls.MARKERS
        return (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    def template_inputs(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for render_chat."""
        if self.format == ToolFormat.GEMMA4:  # tool results where the template reads them
            return gemma4_calls.tool_responses_for_template(messages), self.tools
        if self.format != ToolFormat.JSON:  # hermes, xml: the template renders tools and calls
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
        functions = [(f.name, f.parameters) for f in self.choice.functions if name in (None, f.name)]
        if self.format == ToolFormat.GEMMA4:
            return StructuredOutputsParams(
                grammar=gemma4_calls.gemma4_tool_call_grammar(
                    functions, parallel=self.parallel and name is None, special_ids=dict(self.special_ids)
                )
            )
        if self.format == ToolFormat.XML:
            return StructuredOutputsParams(
                grammar=xml_tool_call_grammar(
                    functions, parallel=self.parallel and name is None, special_markers=self.special_markers
                )
            )
        grammar = tool_call_grammar(
            self.tools, required_name=name, parallel=self.parallel, special_markers=self.special_markers
        )
        return StructuredOutputsParams(grammar=grammar)

    def sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """`params` with what tool calling needs: the enforced grammar (a caller's own
        structured_outputs cannot be combined with it) and special markers kept in the text."""
        params = params if params is not None else SamplingParams()
        enforced = self.enforced()
        if enforced is not None:
            if params.structured_outputs is not None:
                raise InvalidParameterError(
                    "structured_outputs",
                    f"cannot be combined with tool_choice {self.choice.mode!r}, which sets the output's grammar",
                )
            params = dataclasses.replace(params, structured_outputs=enforced)
        if self.tools is not None and self.special_markers:  # the markers must reach the parser
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    @property
    def tool_names(self) -> list[str]:
        return [f.name for f in self.choice.functions]

    def new_parser(self) -> ToolCallParser | None:
        if self.tools is None:
            return None
        # a grammar-constrained call streams its arguments as they are generated (it cannot fail to
        # validate); without one, the parser holds each call until it is complete and valid
        return ToolCallParser(
            self.format,
            tool_names=self.tool_names,
            stream_arguments=self.choice.mode == "required",
            tool_parameters={f.name: f.parameters for f in self.choice.functions},
        )

    def parse(self, out: RequestOutput) -> ToolChatOutput:
        """A finished output -> content and calls (none parsed when tools are not offered)."""
        if self.tools is None:
            return ToolChatOutput(out, out.text.strip() or None, [])
        parser = self.new_parser()
        assert parser is not None, "tools are offered"
        deltas = [parser.feed(out.text), parser.finish()]  # what the server's stream sends, whole
        calls = assemble_tool_calls(deltas)
        content = "".join(d.content for d in deltas) or None
        return ToolChatOutput(out, content, calls if self.parallel else calls[:1])


@dataclass(frozen=True)
class ToolChatOutput:
    """LLM.chat's result when tools are given: the engine's output, then what it said and called."""

    output: RequestOutput  # text, token ids, trace, the engine's finish_reason
    content: str | None  # the text outside calls, stripped (None when empty)
    tool_calls: list[ToolCall]  # id, name, arguments_json (a JSON object as a string)

    @property
    def finish_reason(self) -> str | None:
        """The API's reason: "tool_calls" when the output stopped after calls, else the engine's."""
        reason = self.output.finish_reason
        return "tool_calls" if self.tool_calls and reason == "stop" else reason
