"""Tool calls as text: hermes and json-convention parsing (whole text and streamed, agreeing for every
way of cutting the output), call ids, validation errors that name the parameter, the enforcing JSON
Schema (checked with jsonschema) and the hermes Lark grammar (compiled and run by llguidance over a
byte-level tokenizer, so no model tokenizer is needed)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from onecall.errors import InvalidParameterError
from onecall.tools.calls import (
    ParsedToolCalls,
    ToolCall,
    ToolCallParser,
    assemble_tool_calls,
    new_tool_call_id,
    parse_tool_calls,
)
from onecall.tools.specs import (
    ToolFormat,
    messages_for_json_tools,
    tool_call_grammar,
    tool_call_schema,
    tools_system_prompt,
    validate_tools,
)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time"},
}  # no parameters: arguments must be {}
TOOLS = [WEATHER, TIME]
H = ToolFormat.HERMES
J = ToolFormat.JSON


def hermes_block(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PARIS = hermes_block("get_weather", {"city": "Paris"})
ROME = hermes_block("get_weather", {"city": "Rome", "unit": "c"})
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # a "}" short

# (format, output) -> (content, [(name, arguments_json)])
CASES: list[tuple[ToolFormat, str, str | None, list[tuple[str, str]]]] = [
    (H, PARIS, None, [("get_weather", '{"city": "Paris"}')]),
    (H, "Let me check.\n\n" + PARIS, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (
        H,
        PARIS + "\n" + ROME,
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome", "unit": "c"}')],
    ),
    (H, BROKEN, BROKEN, []),  # malformed JSON stays content
    (H, BROKEN + "\n" + PARIS, BROKEN, [("get_weather", '{"city": "Paris"}')]),
    (H, '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>', None, [("get_time", "{}")]),
    (H, '<tool_call>{"name": "get_time"}</tool_call> done', "done", [("get_time", "{}")]),
    (
        H,
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        None,
        [("get_time", "{}")],
    ),  # EOS before close
    (H, "<tool_call>\n{", None, []),  # a call cut short: not content (its markup must not leak)
    (H, "a < b and <tool_ x", "a < b and <tool_ x", []),
    (H, "Plain answer.", "Plain answer.", []),
    (H, "", None, []),
    (
        J,
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        J,
        '  ```json\n{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time"}]}\n```\n',
        None,
        [("get_time", "{}"), ("get_time", "{}")],
    ),
    (
        J,
        '```\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n``` Done.',
        "Done.",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (J, '{"tool_calls": []}', '{"tool_calls": []}', []),
    (J, '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not calls is content
    (J, '```json\n{"tool_calls": [{"name": "get_', '```json\n{"tool_calls": [{"name": "get_', []),
    (J, "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    (J, "The weather is {sunny}.", "The weather is {sunny}.", []),  # only a leading object counts
    (J, " `x` ", "`x`", []),
    (J, "", None, []),
]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter):09d}"


def streamed(fmt: ToolFormat, pieces: list[str]) -> ParsedToolCalls:
    parser = ToolCallParser(fmt, new_id=ids())
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:  # each call: a head (id, name, no arguments) before any argument fragment
        for piece in delta.tool_calls:
            assert (piece.id is None) == (piece.name is None)
            assert piece.id is None or piece.arguments == ""
    content = "".join(d.content for d in deltas)
    return ParsedToolCalls(content or None, assemble_tool_calls(deltas))


def expected_result(content: str | None, calls: list[tuple[str, str]]) -> ParsedToolCalls:
    make = ids()
    return ParsedToolCalls(content, [ToolCall(make(), name, args) for name, args in calls])


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_text(fmt: ToolFormat, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert parse_tool_calls(text, fmt, new_id=ids()) == expected_result(content, calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_streaming_agrees_for_every_split(
    fmt: ToolFormat, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    whole = parse_tool_calls(text, fmt, new_id=ids())
    for i in range(len(text) + 1):
        assert streamed(fmt, [text[:i], text[i:]]) == whole, f"split at {i}"
    for i in range(0, len(text) + 1, 3):
        for j in range(i, min(len(text), i + 13) + 1):  # a marker or fence cut in three
            assert streamed(fmt, [text[:i], text[i:j], text[j:]]) == whole, f"splits at {i}, {j}"
    assert streamed(fmt, list(text)) == whole


def test_text_that_may_become_a_call_is_held_back() -> None:
    parser = ToolCallParser(H)
    assert parser.feed("Checking <tool_").content == "Checking"  # the space waits too: content is stripped
    out = parser.feed('call>\n{"name": "get_time", "arguments": {}}\n</tool_c')
    assert out.content == "" and out.tool_calls == []
    out = parser.feed("all>")
    assert [(p.index, p.name, p.arguments) for p in out.tool_calls] == [(0, "get_time", ""), (0, None, "{}")]
    assert out.tool_calls[0].id is not None
    parser = ToolCallParser(J)
    assert parser.feed(" ``").content == ""
    assert parser.feed("`js").content == ""
    assert parser.feed("on\n{").content == ""
    assert parser.finish().content == "```json\n{"


def test_tool_names_filter_unknown_calls() -> None:
    text = hermes_block("rm_rf", {}) + PARIS
    parsed = parse_tool_calls(text, H, tool_names={"get_weather"})
    assert parsed.content == hermes_block("rm_rf", {})
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_ids_unique_and_long_enough() -> None:
    made = {new_tool_call_id() for _ in range(2000)}
    assert len(made) == 2000
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in made)
    calls = parse_tool_calls(PARIS + ROME + PARIS, H).tool_calls
    assert len({c.id for c in calls}) == 3 and all(len(c.id) >= 9 for c in calls)


def test_for_template() -> None:
    assert ToolFormat.for_template("{%- for tool in tools %}...<tool_call>\\n{{ call | tojson }}") == H
    assert ToolFormat.for_template("{{ '<|im_start|>' + message['role'] }}") == J
    assert ToolFormat.for_template(None) == J


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param"),
    [
        ([], "required", "tool_choice"),  # [] offers no tools (OpenAI too): only a forced call is wrong
        ("get_weather", None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "city"}}],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        (None, "auto", "tool_choice"),
        (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
    ],
)
def test_validation_errors_name_the_parameter(tools: Any, tool_choice: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        validate_tools(tools, tool_choice)
    assert err.value.param == param
    assert str(err.value).startswith(param + ": ")


def test_validation_results() -> None:
    assert validate_tools(None, None).mode == "none"
    auto = validate_tools(TOOLS, None)
    assert (auto.mode, auto.name, [f.name for f in auto.functions]) == (
        "auto",
        None,
        ["get_weather", "get_time"],
    )
    assert validate_tools(TOOLS, "none").mode == "none"
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name) == ("required", "get_time")
    assert named.functions[1].parameters == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    with pytest.raises(InvalidParameterError, match="tool_choice: names function 'nope'"):
        tool_call_schema(TOOLS, required_name="nope")


def call_doc(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


GOOD_ONE = call_doc(("get_weather", {"city": "Paris"}))
GOOD_TWO = call_doc(("get_weather", {"city": "Paris", "unit": "f"}), ("get_time", {}))
BAD = [
    {"tool_calls": []},
    call_doc(("get_news", {})),
    call_doc(("get_weather", {"town": "Paris"})),
    call_doc(("get_weather", {"city": 7})),
    call_doc(("get_time", {"zone": "UTC"})),
    {"tool_calls": [{"name": "get_time"}]},
    {**GOOD_ONE, "note": "extra"},
]


def test_schema_required_and_named() -> None:
    parallel = tool_call_schema(TOOLS, parallel=True)
    single = tool_call_schema(TOOLS, parallel=False)
    named = tool_call_schema(TOOLS, required_name="get_weather", parallel=True)
    for schema in (parallel, single, named):
        jsonschema.Draft202012Validator.check_schema(schema)
        assert jsonschema.Draft202012Validator(schema).is_valid(GOOD_ONE)
        for bad in BAD:
            assert not jsonschema.Draft202012Validator(schema).is_valid(bad), bad
    assert jsonschema.Draft202012Validator(parallel).is_valid(GOOD_TWO)
    assert not jsonschema.Draft202012Validator(single).is_valid(GOOD_TWO)
    assert not jsonschema.Draft202012Validator(named).is_valid(call_doc(("get_time", {})))
    assert not jsonschema.Draft202012Validator(named).is_valid(
        call_doc(*[("get_weather", {"city": "A"})] * 2)
    )
    # what the schema accepts, the parser reads back as the same calls
    parsed = parse_tool_calls(json.dumps(GOOD_TWO), J)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in GOOD_TWO["tool_calls"]
    ]


def test_system_prompt_and_messages() -> None:
    prompt = tools_system_prompt(TOOLS)
    assert '{"tool_calls": [{"name": "function_name", "arguments": {"argument_name": "value"}}]}' in prompt
    assert (
        json.dumps({"name": "get_weather", **{k: v for k, v in WEATHER["function"].items() if k != "name"}})
        in prompt
    )
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    before = json.dumps(history)
    out = messages_for_json_tools(history, TOOLS)
    assert json.dumps(history) == before  # the input is untouched
    assert out[0]["content"] == "Be brief.\n\n" + prompt
    assert out[2] == {"role": "assistant", "content": json.dumps(GOOD_ONE)}
    assert out[3] == history[3]
    assert messages_for_json_tools(history[1:2], TOOLS)[0] == {"role": "system", "content": prompt}
    # the rewritten assistant turn is itself what the parser reads as that call
    assert [c.name for c in parse_tool_calls(out[2]["content"], J).tool_calls] == ["get_weather"]


def test_text_modules_import_nothing_heavy() -> None:
    """The server calls these pieces; they must stay plain Python (no torch, web framework or engine)."""
    code = (
        "import sys, onecall.tools.calls, onecall.tools.calling, onecall.text.reasoning; "
        "print([m for m in ('torch', 'fastapi', 'onecall.engine', 'onecall.server', 'llguidance') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


llguidance = pytest.importorskip("llguidance")


class _ByteTokenizer:
    """256 one-byte tokens and an EOS: lets llguidance check any string without a model tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_grammars_compile_and_accept_exactly_the_calls(byte_tokenizer: Any) -> None:
    lark = llguidance.LLMatcher.grammar_from_lark
    schema = llguidance.LLMatcher.grammar_from_json_schema
    grammars = {
        "hermes parallel": lark(tool_call_grammar(TOOLS, parallel=True)),
        "hermes single": lark(tool_call_grammar(TOOLS, parallel=False)),
        "hermes named": lark(tool_call_grammar(TOOLS, required_name="get_time")),
        "json parallel": schema(tool_call_schema(TOOLS, parallel=True)),
    }
    for name, grammar in grammars.items():
        assert llguidance.LLMatcher.validate_grammar(grammar, byte_tokenizer) == "", name
    time_call = hermes_block("get_time", {})
    two = PARIS + "\n" + time_call
    assert accepts(byte_tokenizer, grammars["hermes parallel"], two)
    assert not accepts(byte_tokenizer, grammars["hermes single"], two)
    assert accepts(byte_tokenizer, grammars["hermes single"], ROME)
    assert accepts(byte_tokenizer, grammars["hermes named"], time_call)
    assert not accepts(byte_tokenizer, grammars["hermes named"], PARIS)
    for rejected in [
        "Sure! " + PARIS,
        BROKEN,
        hermes_block("get_weather", {"town": "Paris"}),
        PARIS.replace(": ", ":"),
    ]:
        assert not accepts(byte_tokenizer, grammars["hermes parallel"], rejected), rejected
    assert accepts(byte_tokenizer, grammars["json parallel"], json.dumps(GOOD_TWO))
    for bad in BAD:
        assert not accepts(byte_tokenizer, grammars["json parallel"], json.dumps(bad)), bad
    # every string the grammars accept above parses back to its calls
    assert [c.name for c in parse_tool_calls(two, H).tool_calls] == ["get_weather", "get_time"]


def test_the_output_may_end_after_any_call_with_or_without_its_separator(byte_tokenizer: Any) -> None:
    """A tokenizer with one token for ">\\n" (Qwen's) ends "</tool_call" with it: the grammar must accept
    the end there, or the model is forced into another call (it repeated the same call until max_tokens)."""
    lark = llguidance.LLMatcher.grammar_from_lark
    time_call = hermes_block("get_time", {})
    for grammar, text in [
        (tool_call_grammar(TOOLS, parallel=True), PARIS + "\n"),
        (tool_call_grammar(TOOLS, parallel=True), PARIS + "\n" + time_call + "\n"),
        (tool_call_grammar(TOOLS, parallel=False), ROME + "\n"),
        (tool_call_grammar(TOOLS, required_name="get_time"), time_call + "\n"),
    ]:
        assert accepts(byte_tokenizer, lark(grammar), text), text
        assert not accepts(byte_tokenizer, lark(grammar), text + "\n")
        assert not accepts(byte_tokenizer, lark(grammar), text + "Sure")
    # the trailing separator is not content, nor a call
    parsed = parse_tool_calls(PARIS + "\n", H)
    assert parsed.content is None and [c.name for c in parsed.tool_calls] == ["get_weather"]


def test_a_call_cut_short_leaves_no_markup_in_the_content() -> None:
    """max_tokens in the middle of a call: under a grammar its head and arguments so far were streamed
    (a partial call, finish_reason "length", as OpenAI's streams do); without one nothing of it goes
    out. Either way "<tool_call>" never reaches the content."""
    cut = "Let me check.\n" + PARIS + "\n" + PARIS[: PARIS.index("Paris") + 2]  # inside the arguments
    for stream_arguments in (False, True):
        parser = ToolCallParser(H, new_id=ids(), stream_arguments=stream_arguments)
        deltas = [parser.feed(piece) for piece in (cut[:20], cut[20:])] + [parser.finish()]
        content = "".join(d.content for d in deltas)
        assert content == "Let me check." and "<tool_call>" not in content
        calls = assemble_tool_calls(deltas)
        assert calls[0].name == "get_weather" and len(calls) == (2 if stream_arguments else 1)


def test_special_marker_grammar_compiles() -> None:
    grammar = tool_call_grammar(TOOLS, special_markers=True)
    assert grammar.startswith("start: call") and "<tool_call> " in grammar and '"<tool_call>"' not in grammar
    # special-token references resolve only against a tokenizer that has them: checked without one
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


# ---- streamed arguments (grammar-constrained output) ---------------------------------------------------
CONSTRAINED = [
    (
        J,
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"}{ris", "days": [1, {"a": 2}]}}, '
        '{"name": "get_time", "arguments": {}}]}',
    ),
    (
        H,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "}\\\\"}}\n</tool_call>',
    ),
]


@pytest.mark.parametrize(("fmt", "text"), CONSTRAINED)
def test_constrained_arguments_stream_as_generated(fmt: ToolFormat, text: str) -> None:
    """Head first (id, name, arguments ""), then the raw arguments in pieces; whole == streamed for any
    split, and the arguments are the text's own (what the grammar pinned)."""
    expected = [(c["name"], json.dumps(c["arguments"])) for c in _calls_in(text)]
    for splits in (list(text), [text[:40], text[40:]], [text]):
        parser = ToolCallParser(fmt, new_id=ids(), stream_arguments=True)
        deltas = [parser.feed(piece) for piece in splits] + [parser.finish()]
        assert "".join(d.content for d in deltas) == ""
        calls = assemble_tool_calls(deltas)
        assert [(c.name, c.arguments_json) for c in calls] == expected
        pieces = [p for d in deltas for p in d.tool_calls]
        for index in range(len(expected)):
            mine = [p for p in pieces if p.index == index]
            assert mine[0].name == expected[index][0] and mine[0].id and mine[0].arguments == ""
            assert all(p.id is None and p.name is None for p in mine[1:])
            if len(splits) == len(text):
                assert len(mine) - 1 == len(expected[index][1]), "one fragment per character fed"


def test_constrained_arguments_cut_short_stay_partial() -> None:
    """max_tokens can cut a constrained call: its head and the arguments so far were sent (as OpenAI
    streams them), and the finish_reason ("length") says the call is unfinished."""
    parser = ToolCallParser(J, new_id=ids(), stream_arguments=True)
    deltas = [parser.feed('{"tool_calls": [{"name": "get_time", "arguments": {"zo'), parser.finish()]
    assert [(c.name, c.arguments_json) for c in assemble_tool_calls(deltas)] == [("get_time", '{"zo')]


def test_unpinned_layout_falls_back_to_whole_calls() -> None:
    """Output not in the grammar's layout (other spacing) is never streamed early: whole calls, as before."""
    text = '{"tool_calls":[{"name":"get_time","arguments":{"zone":"UTC"}}]}'
    parser = ToolCallParser(J, new_id=ids(), stream_arguments=True)
    assert parser.feed(text[:-3]).tool_calls == []
    rest = [parser.feed(text[-3:]), parser.finish()]
    assert [(c.name, c.arguments_json) for c in assemble_tool_calls(rest)] == [
        ("get_time", '{"zone": "UTC"}')
    ]


def _calls_in(text: str) -> list[dict[str, Any]]:
    if text.startswith("{"):
        return json.loads(text)["tool_calls"]  # type: ignore[no-any-return]
    return [json.loads(block.split("\n")[1]) for block in text.split("<tool_call>")[1:]]
