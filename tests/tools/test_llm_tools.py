"""LLM.chat(tools=..., tool_choice=...): the library's tool calling, the one implementation the server's
chat endpoint and the lab's tools experiment call (tools/calling.py).

A tiny random-weight model with the embedded model's tokenizer and template (no tool format, so the
json convention): a forced call goes through the grammar, so it parses even from random weights; the
tool's one parameter is an enum, so the call has a fixed length and fits max_tokens.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from onecall import LLM, InvalidParameterError, SamplingParams, StructuredOutputsParams, ToolChatOutput
from onecall.server import serving_chat
from onecall.tools import calling as tool_calling
from onecall.tools.specs import tools_system_prompt
from tests.helpers.tiny_engine import tiny_engine

pytest.importorskip("llguidance")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["unit"],
            },
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(engine=tiny_engine())


def params(max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_forced_call_parses_into_the_output(llm: LLM, tool_choice: Any) -> None:
    out = llm.chat(MESSAGES, params(), tools=TOOLS, tool_choice=tool_choice)[0]
    assert isinstance(out, ToolChatOutput)
    assert out.output.finish_reason == "stop", out.output.text  # the grammar ended it
    assert [c.name for c in out.tool_calls] == ["get_weather"]
    assert json.loads(out.tool_calls[0].arguments_json)["unit"] in ("c", "f")
    assert out.tool_calls[0].id.startswith("call_")
    assert out.finish_reason == "tool_calls" and out.content is None


def test_a_batch_gets_one_result_per_conversation(llm: LLM) -> None:
    outs = llm.chat([MESSAGES, MESSAGES], params(), tools=TOOLS, tool_choice="required")
    assert [len(o.tool_calls) for o in outs] == [1, 1]


def test_none_withdraws_the_tools(llm: LLM) -> None:
    out = llm.chat(MESSAGES, params(8), tools=TOOLS, tool_choice="none")[0]
    assert out.tool_calls == [] and out.content == (out.output.text.strip() or None)
    assert out.finish_reason == out.output.finish_reason
    assert "get_weather" not in llm.render(MESSAGES, tools=TOOLS, tool_choice="none").text


def test_auto_parses_without_a_grammar(llm: LLM) -> None:
    out = llm.chat(MESSAGES, params(8), tools=TOOLS)[0]
    expected = tool_calling.ChatTools.build(TOOLS, "auto", llm.tokenizer).parse(out.output)
    assert out.content == expected.content and len(out.tool_calls) == len(expected.tool_calls)


def test_render_offers_tools_as_chat_does(llm: LLM) -> None:
    """No tool format in the template: the json convention's system prompt carries the tools."""
    rendered = llm.render(MESSAGES, tools=TOOLS)
    assert tools_system_prompt(TOOLS) in rendered.text
    assert "get_weather" not in llm.render(MESSAGES).text


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param"),
    [
        ([], "required", "tool_choice"),  # [] offers no tools (OpenAI too): only a forced call is wrong
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ],
)
def test_bad_tools_are_typed_errors(llm: LLM, tools: Any, tool_choice: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        llm.chat(MESSAGES, params(), tools=tools, tool_choice=tool_choice)
    assert e.value.param.startswith(param)


def test_a_forced_call_refuses_another_grammar(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(InvalidParameterError, match="tool_choice"):
        llm.chat(MESSAGES, sp, tools=TOOLS, tool_choice="required")


def test_the_server_uses_the_same_implementation() -> None:
    assert serving_chat.ChatTools is tool_calling.ChatTools
