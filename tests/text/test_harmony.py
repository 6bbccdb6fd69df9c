"""gpt-oss's harmony format (onecall/text/harmony.py) against openai-harmony itself.

Rendering: an OpenAI-style conversation (system, user, an assistant turn with reasoning and a call, the
tool's result, tools) renders to exactly the ids openai-harmony renders for the same conversation
built by hand. Parsing: a completion built with harmony (analysis, a commentary call to
functions.get_weather, then final) splits into reasoning, content and the call, whole and fed token by
token; garbage never raises. Detection: architecture gpt_oss, or <|channel|> a special token.
"""

from __future__ import annotations

import datetime
import json

import pytest

h = pytest.importorskip("openai_harmony")

from onecall.text.harmony import (  # noqa: E402
    HarmonyDelta,
    HarmonyStream,
    harmony_encoding,
    parse_harmony,
    render_harmony,
    speaks_harmony,
    stop_token_ids,
)
from tests.helpers.tiny_engine import embedded_tokenizer  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    }
]
COMPLETION = (
    "<|channel|>analysis<|message|>The user wants Paris's weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
FINAL = "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 C.<|return|>"


@pytest.fixture(scope="module")
def enc() -> object:
    return harmony_encoding()


def encode(enc: object, text: str) -> list[int]:
    return list(enc.encode(text, allowed_special="all"))  # type: ignore[attr-defined]


def test_rendering_equals_harmony_rendering(enc: object) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool.",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    ours = render_harmony(messages, TOOLS, reasoning_effort="low")

    today = datetime.date.today().isoformat()  # render_harmony dates the system message, as the template does
    system = (
        h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort.LOW).with_conversation_start_date(today)
    )
    developer = (
        h.DeveloperContent.new()
        .with_instructions("Answer briefly.")
        .with_function_tools([h.ToolDescription.new("get_weather", "The weather", parameters=WEATHER)])
    )
    conversation = h.Conversation.from_messages(
        [
            h.Message.from_role_and_content(h.Role.SYSTEM, system),
            h.Message.from_role_and_content(h.Role.DEVELOPER, developer),
            h.Message.from_role_and_content(h.Role.USER, "Weather in Paris?"),
            h.Message.from_role_and_content(h.Role.ASSISTANT, "Call the tool.").with_channel("analysis"),
            h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city": "Paris"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), "sunny")
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    theirs = enc.render_conversation_for_completion(conversation, h.Role.ASSISTANT)  # type: ignore[attr-defined]
    assert ours.token_ids == list(theirs)
    assert ours.text.endswith("<|start|>assistant") and "functions.get_weather" in ours.text
    assert ours.is_control[0] and sum(ours.is_control) > 0


def test_plain_conversation_renders(enc: object) -> None:
    ours = render_harmony([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    system = h.SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    conversation = h.Conversation.from_messages(
        [
            h.Message.from_role_and_content(h.Role.SYSTEM, system),
            h.Message.from_role_and_content(h.Role.USER, "Hi"),
        ]
    )
    theirs = enc.render_conversation_for_completion(conversation, h.Role.ASSISTANT)  # type: ignore[attr-defined]
    assert ours.token_ids == list(theirs)


def test_stop_tokens(enc: object) -> None:
    assert stop_token_ids() == tuple(sorted(encode(enc, "<|return|>") + encode(enc, "<|call|>")))


@pytest.mark.parametrize("one_by_one", [False, True])
def test_parse_analysis_call_final(enc: object, one_by_one: bool) -> None:
    ids = encode(enc, COMPLETION) + encode(enc, "<|start|>assistant" + FINAL)
    stream = HarmonyStream()
    delta = HarmonyDelta()
    for piece in [[t] for t in ids] if one_by_one else [ids]:
        delta.add(stream.feed(piece))
    delta.add(stream.finish())
    assert delta.reasoning == "The user wants Paris's weather.It is sunny."
    assert delta.content == "Sunny, 21 C."
    heads = [c for c in delta.calls if c.id is not None]
    assert [(c.index, c.name, c.arguments) for c in heads] == [(0, "get_weather", "")]
    assert json.loads("".join(c.arguments for c in delta.calls)) == {"city": "Paris"}
    assert stream.num_calls == 1


def test_parse_whole(enc: object) -> None:
    parsed = parse_harmony(encode(enc, COMPLETION))
    assert parsed.reasoning_content == "The user wants Paris's weather."
    assert parsed.content is None
    [(call_id, name, arguments)] = parsed.calls
    assert (
        call_id.startswith("call_") and name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    )
    final = parse_harmony(encode(enc, FINAL))
    assert (final.reasoning_content, final.content, final.calls) == ("It is sunny.", "Sunny, 21 C.", [])


def test_garbage_never_raises(enc: object) -> None:
    for ids in (
        [1, 2, 3],
        encode(enc, "<|message|><|end|><|call|>hello"),
        encode(enc, "<|channel|>final<|message|>ok<|start|><|start|>x"),
    ):
        parsed = parse_harmony(ids)
        assert parsed.calls == [] or all(name for _, name, _ in parsed.calls)


@pytest.mark.slow  # builds gpt-oss's 200k-token tokenizer (~3 s)
def test_detection() -> None:
    """By the vocabulary, not the architecture: <|channel|> one special token at o200k_harmony's id."""
    from tests.system.test_harmony_server import harmony_tokenizer

    assert not speaks_harmony(embedded_tokenizer())  # a gpt_oss file with another vocabulary: its template
    assert speaks_harmony(harmony_tokenizer())
