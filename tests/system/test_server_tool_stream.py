"""Tool-call arguments stream as they are generated (issue 12), through a real `onecall serve` and the
official openai client.

With tool_choice "required" or a named function the output runs under a grammar, so every call is
valid: each call's first delta carries index, id, type and name (arguments ""), and its arguments
follow in several fragments as tokens arrive. With "auto" (no grammar) a call is held back until it is
complete and validated. Either way the openai library's stream accumulation must rebuild exactly the
calls of the non-streamed response (ids are random per response; names and arguments must match).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.helpers.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]  # the embedded model behind a subprocess

NAME = "onecall-tool-stream"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a time zone", "parameters": ZONE}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    proc = ServerProcess("--served-model-name", NAME, "--max-model-len", "1024", num_threads=2)
    try:
        proc.start()
        yield openai.OpenAI(base_url=proc.url("/v1"), api_key="-", max_retries=0, timeout=60)
    finally:
        proc.stop()


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, **kw)  # type: ignore[arg-type]


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def stream(client: openai.OpenAI, **kw: Any) -> tuple[Any, dict[int, list[Any]]]:
    """(the openai library's accumulated completion, each call's deltas in order)."""
    state, deltas = ChatCompletionStreamState(), {}
    for chunk in chat(client, stream=True, **kw):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                deltas.setdefault(d.index, []).append(d)
    return state.current_completion_snapshot, deltas  # get_final_completion refuses "length"


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_constrained_arguments_stream_in_fragments(client: openai.OpenAI, tool_choice: Any) -> None:
    whole = chat(client, tool_choice=tool_choice, max_tokens=80).choices[0]
    assert whole.finish_reason == "tool_calls"
    streamed, deltas = stream(client, tool_choice=tool_choice, max_tokens=80)
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert calls_of(streamed.choices[0].message) == calls_of(whole.message)
    assert [c.id for c in streamed.choices[0].message.tool_calls] == [d[0].id for d in deltas.values()]
    for index, pieces in deltas.items():
        first, rest = pieces[0], pieces[1:]
        assert first.index == index and first.id and first.id.startswith("call_") and first.type == "function"
        assert first.function.name and first.function.arguments == ""
        assert all(p.id is None and p.function.name is None for p in rest)
        assert len(rest) > 2, "the arguments came in one piece, not as they were generated"
        json.loads("".join(p.function.arguments for p in rest))


def test_auto_rebuilds_the_same_calls(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=60).choices[0]
    streamed, _ = stream(client, max_tokens=60)
    assert streamed.choices[0].finish_reason == whole.finish_reason
    assert calls_of(streamed.choices[0].message) == calls_of(whole.message)
    assert (streamed.choices[0].message.content or None) == whole.message.content
