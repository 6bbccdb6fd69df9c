"""Structured outputs and tool calls over HTTP: a real `onecall serve` with the embedded model.

SmolLM2's template knows no tools, so tools use the JSON convention (tools/specs.py); reasoning
and Hermes calls are tested in-process in test_server_reasoning.py. The tests on the subprocess are
marked `server` (`make test-fast` leaves them out).

What is checked, with the official openai client (raw httpx for bad bodies): response_format
json_schema (the content validates with jsonschema; the trace shows the grammar) and json_object, on
chat and completions; structured_outputs regex, choice and grammar; a streamed schema's content
validates; tool_choice "required" and a named function give finish_reason "tool_calls", ids of 9+
characters and arguments that validate against the parameters, the same calls through the stream
(accumulated by hand and by the openai library's own stream state); parallel_tool_calls false gives
one call; a round trip (assistant tool_calls + tool message) renders both and answers; "auto" gives
content or valid calls; "none" gives no calls and offers no tools; every bad input is a 400 naming its
field, each followed by a request that works.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from onecall.errors import InvalidParameterError
from onecall.sampling_params import StructuredOutputsParams
from onecall.server.params import requested_structured_outputs, to_sampling_params
from onecall.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers.server_process import ServerProcess, assert_error, check_chat_stream

NAME = "onecall-structured"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ANN = [{"role": "user", "content": "Give me a person named Ann who is 31."}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a time zone", "parameters": ZONE}},
]  # fmt: skip
PARAMETERS = {"get_weather": WEATHER, "get_time": ZONE}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--served-model-name", NAME, "--max-model-len", "1024", num_threads=2)
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="-", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]


def check_calls(calls: list[Any]) -> list[tuple[str, Any]]:
    """Every call is a function call with an OpenAI-style id and arguments valid for its function."""
    out = []
    for call in calls:
        assert call.type == "function" and len(call.id) >= 9 and call.function.name in PARAMETERS
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        out.append((call.function.name, arguments))
    return out


# ---- the conversion, without a server -------------------------------------------------------------
def test_requests_become_structured_outputs_params() -> None:
    def asked(**kw: Any) -> Any:
        req = ChatCompletionRequest.model_validate({"messages": PARIS, **kw})
        return requested_structured_outputs(req)

    assert asked() is None and asked(response_format={"type": "text"}) is None
    assert asked(response_format={"type": "json_object"}) == (
        StructuredOutputsParams(json_object=True),
        "response_format",
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert asked(response_format=fmt) == (StructuredOutputsParams(json=PERSON), "response_format")
    so = StructuredOutputsParams(regex="[0-9]+")
    assert asked(structured_outputs={"regex": "[0-9]+"}) == (so, "structured_outputs")
    assert asked(response_format={"type": "text"}, structured_outputs={"regex": "[0-9]+"})[0] == so
    completion = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a"]}})
    found = requested_structured_outputs(completion)
    assert found is not None and found[0].choice == ("a",)
    (params,) = to_sampling_params(completion, default_max_tokens=4, structured_outputs=found[0])
    assert params.structured_outputs == found[0]
    for bad, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ]:
        with pytest.raises(InvalidParameterError) as e:
            asked(**bad)
        assert e.value.param == param


# ---- response_format and structured_outputs --------------------------------------------------------
@pytest.mark.server
def test_json_schema_response_validates_and_the_trace_shows_the_grammar(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(client, ANN, response_format=fmt, max_tokens=40, extra_body={"trace": True})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    grammar = r.model_extra["trace"]["grammar"]
    assert grammar["kind"] == "json" and grammar["activated_at"] == 0 and grammar["error"] is None
    steps = [s for s in r.model_extra["trace"]["steps"] if s["token_id"] is not None]
    assert all(s["num_allowed"] is not None and s["num_masked"] > 0 for s in steps)


@pytest.mark.server
def test_json_object_and_completions(client: openai.OpenAI) -> None:
    r = chat(client, ANN, response_format={"type": "json_object"}, max_tokens=40)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    c = client.completions.create(
        model=NAME,
        prompt="Ann is 31. As JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)
    c = client.completions.create(
        model=NAME, prompt="Is Paris in France?", max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )  # fmt: skip
    assert c.choices[0].text in ("yes", "no") and c.choices[0].finish_reason == "stop"


@pytest.mark.server
@pytest.mark.parametrize(
    ("structured_outputs", "pattern"),
    [
        ({"regex": "[0-9]{3}-[a-z]{2}"}, "[0-9]{3}-[a-z]{2}"),
        ({"choice": ["red", "green", "blue"]}, "red|green|blue"),
        ({"grammar": 'start: "age " NUM\nNUM: /[1-9][0-9]?/'}, "age [1-9][0-9]?"),
    ],
)
def test_structured_outputs_extension(client: openai.OpenAI, structured_outputs: dict, pattern: str) -> None:
    r = chat(client, ANN, max_tokens=10, extra_body={"structured_outputs": structured_outputs})
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.server
def test_a_streamed_schema_output_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = chat(
        client, ANN, response_format=fmt, max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    (text,) = check_chat_stream(chunks)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"


# ---- tools ------------------------------------------------------------------------------------------
def streamed_calls(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> tuple[list[Any], str]:
    """The stream's calls as the openai library assembles them; checks the deltas' shape on the way."""
    state, seen_ids, finish = ChatCompletionStreamState(), set(), None
    for chunk in chat(client, messages, stream=True, **kw):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: id, type and name, once
                    assert d.type == "function" and d.function.name and d.id not in seen_ids
                    seen_ids.add(d.id)
                else:
                    assert d.function.name is None and d.function.arguments is not None
    calls = state.get_final_completion().choices[0].message.tool_calls or []
    assert len(calls) == len(seen_ids)
    return calls, finish


@pytest.mark.server
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_enforced_calls_are_valid_whole_and_streamed(client: openai.OpenAI, tool_choice: Any) -> None:
    r = chat(client, PARIS, tools=TOOLS, tool_choice=tool_choice, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message.tool_calls)
    if tool_choice == NAMED:
        assert [name for name, _ in calls] == ["get_time"]
    streamed, finish = streamed_calls(client, PARIS, tools=TOOLS, tool_choice=tool_choice, max_tokens=60)
    assert finish == "tool_calls" and check_calls(streamed) == calls


@pytest.mark.server
def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}]
    r = chat(client, ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assert (
        r.choices[0].finish_reason == "tool_calls" and len(check_calls(r.choices[0].message.tool_calls)) == 1
    )


@pytest.mark.server
def test_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    first = chat(client, PARIS, tools=TOOLS, tool_choice=NAMED, max_tokens=60).choices[0].message
    (call,) = first.tool_calls
    history = [
        *PARIS,
        first.model_dump(exclude_none=True),  # as a client sends it back: content None, tool_calls
        {"role": "tool", "tool_call_id": call.id, "content": "It is 14:05 in Paris."},
    ]
    r = chat(client, history, tools=TOOLS, tool_choice="none", max_tokens=30, extra_body={"trace": True})
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls == []
    assert r.choices[0].message.content
    prompt = r.model_extra["trace"]["prompt_text"]
    assert "It is 14:05 in Paris." in prompt and call.function.arguments in prompt  # both rendered
    assert "# Tools" not in prompt  # tool_choice "none": no tools offered


@pytest.mark.server
def test_auto_gives_content_or_valid_calls(client: openai.OpenAI) -> None:
    for ask in [PARIS, [{"role": "user", "content": "Say hello."}]]:
        r = chat(client, ask, tools=TOOLS, max_tokens=40)
        message = r.choices[0].message
        if message.tool_calls:
            check_calls(message.tool_calls)
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content and r.choices[0].finish_reason in ("stop", "length")


# ---- bad input ----------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}


@pytest.mark.server
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"response_format": BAD_SCHEMA}, "response_format"),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
        (CHAT, {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
        (CHAT, {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
        (CHAT, {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
         "structured_outputs.json"),
        (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (CHAT, {"structured_outputs": {"grammar": "start: " + " ".join(['"x"'] * 70_000)}}, "structured_outputs.grammar"),
        (CHAT, {"tools": [], "tool_choice": "required"}, "tool_choice"),
        (CHAT, {"tool_choice": "auto"}, "tool_choice"),
        (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        (CHAT, {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}], "tool_choice": "required"}, "tools"),
        (COMPLETIONS, {"response_format": BAD_SCHEMA}, "response_format"),
        (COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    base = {"messages": PARIS} if path == CHAT else {"prompt": "Hi"}
    r = httpx.post(server.url(path), json={**base, "max_tokens": 2, **body}, timeout=60)
    err = assert_error(r, 400, param=param)
    assert "Traceback" not in err["message"] and len(err["message"]) > len(param)
    ok = httpx.post(server.url(path), json={**base, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, ok.text
