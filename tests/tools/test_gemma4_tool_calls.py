"""Gemma 4's own tool calls (tools/gemma4_calls.py, ToolFormat.GEMMA4): detection from the real template,
the parser whole and streamed (the same content and calls for every way of cutting the output), values
typed as written, malformed input, calls the real template renders parsed back to their arguments, the
forced-call grammar (compiled by GrammarBackend on the embedded model's real tokenizer, with Gemma 4's
markers as text pieces and as special tokens, and fed its tokens), the history's tool results rendered
where the template reads them (checked against transformers), and calls through the server (in-process,
the official openai client) from a scripted model under the real Gemma 4 template, with the markers
either kind of token."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from onecall.config import EngineConfig
from onecall.engine.engine import Engine
from onecall.engine.engine_parts import LoadedEngineParts
from onecall.errors import InvalidParameterError
from onecall.formats.checkpoint import resolve_model
from onecall.formats.gguf import open_gguf
from onecall.model.kv_cache import PagedKVCache
from onecall.sampling.grammar import GrammarBackend
from onecall.sampling_params import StructuredOutputsParams
from onecall.server.params import template_messages
from onecall.server.protocol import ChatCompletionRequest
from onecall.server.serving_tools import chat_tools, markers_are_special
from onecall.text.chat_template import ChatTemplate, render_chat
from onecall.text.reasoning import ReasoningFormat
from onecall.text.tokenizer import Tokenizer
from onecall.tools.calling import ChatTools
from onecall.tools.calls import ToolCallParser, parse_tool_calls
from onecall.tools.gemma4_calls import CALL_CLOSE, CALL_OPEN, QUOTE, scan_call, tool_responses_for_template
from onecall.tools.specs import ToolFormat
from tests.helpers.tool_streams import call_ids, splits, stream_parse
from tests.system.test_server_reasoning import EOS, MODEL, ScriptedLM, both, serve
from tests.text.test_chat_templates_real import (
    TEMPLATES,
    _conversations,
    _model_folder,
    _reference_tokenizer,
    _wire,
)

DATA = Path(__file__).parent.parent / "data" / "chat_templates"
GEMMA4 = (DATA / "google-gemma-4-31B-it-interleaved.jinja").read_text(encoding="utf-8")
G = ToolFormat.GEMMA4
Q = QUOTE

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "hot": {"type": "boolean"},
        "opts": {"type": "object", "properties": {"a": {"type": "array"}}},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "version": {"type": "string"},
    },
    "required": ["city"],
}
TIME_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


def call(name: str, body: str = "") -> str:
    """A call as the model writes one, `body` the text between the braces."""
    return f"{CALL_OPEN}call:{name}{{{body}}}{CALL_CLOSE}"


PARIS = call("get_weather", f"city:{Q}Paris{Q},days:3")
ROME = call(
    "get_weather", f"city:{Q}Rome, {{Italy}}\n[x]: y{Q},hot:true,opts:{{a:[1,{Q}x{Q},None,-2.5e-07]}}"
)
TIME = call("get_time")
PARIS_JSON = '{"city": "Paris", "days": 3}'

# output -> (content, [(name, arguments_json)])
CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (PARIS, None, [("get_weather", PARIS_JSON)]),
    ("Let me check.\n" + PARIS + "\nDone.", "Let me check.\n\nDone.", [("get_weather", PARIS_JSON)]),
    (
        PARIS + ROME + TIME,  # back to back, as the template writes several
        None,
        [
            ("get_weather", PARIS_JSON),
            ("get_weather", '{"city": "Rome, {Italy}\\n[x]: y", "hot": true, "opts": {"a": [1, "x", null, -2.5e-07]}}'),
            ("get_time", "{}"),
        ],
    ),
    # a string holds any text, look-alike markers included: the structure decides
    (call("get_weather", f"city:{Q}a }}{CALL_CLOSE} b{Q}"), None, [("get_weather", f'{{"city": "a }}{CALL_CLOSE} b"}}')]),
    # keys may be marked; whitespace between tokens is allowed; a repeated key keeps its first value
    (call("get_weather", f" {Q}city{Q} : {Q}Paris{Q} , days : 3 , days:4 "), None, [("get_weather", PARIS_JSON)]),
    ("No call here, just {braces} and <b>tags</b>.", "No call here, just {braces} and <b>tags</b>.", []),
    # malformed: a closed block that is not a call stays content, as the other formats keep theirs
    (call("get_news"), call("get_news"), []),  # a function not offered
    (
        f"{CALL_OPEN}call:get_weather{{city:{Q}Paris{Q}{CALL_CLOSE} ok",  # the object never closes
        f"{CALL_OPEN}call:get_weather{{city:{Q}Paris{Q}{CALL_CLOSE} ok",
        [],
    ),
    (
        f'{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}' + TIME,  # hermes JSON is not this format
        f'{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}',
        [("get_time", "{}")],
    ),
    (call("get_weather", "city:,days:3"), call("get_weather", "city:,days:3"), []),  # a key without a value
    # unclosed at the end: a call cut short (max_tokens) is dropped, a string never closed included;
    # a call whose object closed but whose <tool_call|> never came still counts
    ("Checking.\n" + PARIS[:-20], "Checking.", []),
    ("Checking.\n" + call("get_weather", f"city:{Q}Par")[: -len("}" + CALL_CLOSE)], "Checking.", []),
    ("Checking.\n" + PARIS[: -len(CALL_CLOSE)], "Checking.", [("get_weather", PARIS_JSON)]),
    ("Checking. <|tool_", "Checking. <|tool_", []),  # a marker's start that never became one is text
    # a string never closed, but the block's marker came: not cut short, so its text is content
    (
        f"{CALL_OPEN}call:get_weather{{city:{Q}Paris}}{CALL_CLOSE} I meant Paris.",
        f"{CALL_OPEN}call:get_weather{{city:{Q}Paris}}{CALL_CLOSE} I meant Paris.",
        [],
    ),
]  # fmt: skip


def run(
    text: str, pieces: list[str], *, stream_arguments: bool = False
) -> tuple[str | None, list[tuple[str, str]]]:
    return stream_parse(G, PARAMETERS, text, pieces, stream_arguments=stream_arguments)


def test_the_real_templates_choose_their_format() -> None:
    assert ToolFormat.for_template(GEMMA4) == G
    for name, fmt in (
        ("qwen3.5", ToolFormat.XML),
        ("qwen3", ToolFormat.HERMES),
        ("llama3.1", ToolFormat.JSON),
    ):
        assert ToolFormat.for_template(TEMPLATES[name].source) == fmt, name


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_text(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed = parse_tool_calls(text, G, tool_parameters=PARAMETERS)
    assert (parsed.content, [(c.name, c.arguments_json) for c in parsed.tool_calls]) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_streams_the_same(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(text):
        assert run(text, pieces) == (content, calls), pieces


def test_text_that_may_become_a_call_is_held_back() -> None:
    parser = ToolCallParser(G, tool_parameters=PARAMETERS, new_id=call_ids())
    assert parser.feed("Sure. <|tool_").content == "Sure."
    out = parser.feed(f"call>call:get_weather{{city:{Q}Pa")
    assert out.content == "" and out.tool_calls == []  # auto: held until the call is complete
    out = parser.feed(f"ris{Q}}}{CALL_CLOSE} ok")
    assert out.content == "  ok" and [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", ""),
        (None, '{"city": "Paris"}'),
    ]
    assert parser.finish().content == ""  # the text around the call: "Sure." then "  ok"


@pytest.mark.parametrize(
    ("body", "value"),
    [
        ("days:3", 3),  # bare tokens are typed as written ...
        ("days:-2.5", -2.5),
        ("hot:false", False),
        ("hot:True", True),
        ("days:None", None),  # ... the template writes None with str()
        ("days:null", None),
        ("unit:None", "None"),  # under a string-only schema a bare token is the text
        ("days:007", "007"),  # not a JSON number: the text
        ("days:Paris", "Paris"),  # a string whose markers were forgotten
        ("version:1.10", "1.10"),  # a bare token under a string-only schema stays the text as written
        (f"days:{Q}3{Q}", "3"),  # a marked string is a string, whatever the schema says
        ("opts:{b:1.10}", {"b": 1.1}),  # an object the schema does not describe: as written
        ("zone:1.10", 1.1),  # a key the schema does not name: as written
    ],
)
def test_values_are_typed_as_written(body: str, value: Any) -> None:
    scan = scan_call(f"call:get_weather{{{body}}}{CALL_CLOSE}", None, PARAMETERS)
    assert scan.state == "complete" and len(scan.arguments) == 1 and scan.arguments[0][1] == value


def test_scan_tells_a_prefix_from_text_that_cannot_be_a_call() -> None:
    full = ROME[len(CALL_OPEN) :]
    for i in range(len(full)):  # every prefix of a call is "partial", never "invalid"
        assert scan_call(full[:i], list(PARAMETERS), PARAMETERS).state == "partial", full[:i]
    assert scan_call(full, list(PARAMETERS), PARAMETERS).state == "complete"
    for text in [
        "cal:f{}",
        "call:{}",
        "call:get_time[]",
        "call:get_time{}}",
        "call:get_time{} x",
        "call:other{}",
    ]:
        assert scan_call(text, list(PARAMETERS), PARAMETERS).state == "invalid", text


ARGS: dict[str, Any] = {
    "city": 'São Paulo, "SP" {x} [y]\nline two',
    "days": 3,
    "hot": True,
    "opts": {"a": [1, 2.5e-07, None, False, {"k": "v"}], "Z": {}},
    "unit": "c",
    "version": "",
}


def test_calls_the_template_renders_parse_back() -> None:
    """The real template writes a history call with format_argument (transformers' rendering is checked
    to be the same text); parsed back, the call has the arguments it was given."""
    messages: Any = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
    ]
    want = _reference_tokenizer(TEMPLATES["gemma4"]).apply_chat_template(
        copy.deepcopy(messages), tools=list[Any](TOOLS), tokenize=False, add_generation_prompt=False
    )
    got = ChatTemplate(GEMMA4, bos_token="<bos>", eos_token="<eos>").render(
        copy.deepcopy(messages), tools=copy.deepcopy(TOOLS), add_generation_prompt=False
    )
    assert got == want
    assert got.count("<|tool>declaration:") == 2  # the tools are declared in the template's own syntax
    turn = got.index("<|turn>model\n") + len("<|turn>model\n")
    text = got[turn : got.index("<turn|>", turn)]
    assert text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE)
    for parameters in (PARAMETERS, None):  # typed as written: the schema changes nothing here
        parsed = parse_tool_calls(text, G, tool_parameters=parameters)
        assert parsed.content is None
        assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [
            ("get_weather", ARGS),
            ("get_time", {}),
        ]


def test_constrained_calls_stream_pair_by_pair() -> None:
    parser = ToolCallParser(G, tool_parameters=PARAMETERS, new_id=call_ids(), stream_arguments=True)
    deltas = [parser.feed(c) for c in PARIS] + [parser.finish()]
    first = [p for d in deltas for p in d.tool_calls if p.index == 0]
    assert first[0].name == "get_weather" and first[0].id and first[0].arguments == ""
    assert [p.arguments for p in first[1:]] == ["{", '"city": "Paris"', ', "days": 3', "}"]
    text = PARIS[: PARIS.index("days") + 6]  # cut short inside the last value: the call stays partial
    assert run(text, list(text), stream_arguments=True) == (None, [("get_weather", '{"city": "Paris"')])


# ---- the markers as text pieces or as special tokens -----------------------------------------------------
TOOL_MARKERS = {12: CALL_OPEN, 13: CALL_CLOSE, 14: QUOTE}  # unused jupyter tokens of the embedded vocabulary
CHANNEL_MARKERS = {15: "<|channel>", 16: "<channel|>"}


def gemma4_tokenizer(marker_type: int) -> Tokenizer:
    """The embedded model's vocabulary with Gemma 4's call markers as user-defined pieces (type 4, what
    a Gemma 4 GGUF holds: kept in the text) or control tokens (type 3, special: dropped from the text
    unless skip_special_tokens is off), its reasoning markers as pieces, and the real Gemma 4 template."""
    metadata = dict(open_gguf(resolve_model(None).path).metadata)
    tokens, types = list(metadata["tokenizer.ggml.tokens"]), list(metadata["tokenizer.ggml.token_type"])
    for i, marker in TOOL_MARKERS.items():
        tokens[i], types[i] = marker, marker_type
    for i, marker in CHANNEL_MARKERS.items():
        tokens[i], types[i] = marker, 4
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    metadata["tokenizer.chat_template"] = GEMMA4
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert [tok.encode(m) for m in TOOL_MARKERS.values()] == [[i] for i in TOOL_MARKERS]
    return tok


@pytest.fixture(scope="module", params=[4, 3], ids=["text-markers", "special-markers"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return gemma4_tokenizer(request.param)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer)


def test_the_markers_reach_the_parser_either_way(tokenizer: Tokenizer) -> None:
    tools = ChatTools.build(TOOLS, "auto", tokenizer)
    special = bool(tokenizer.special_ids & set(TOOL_MARKERS))
    assert tools.format == G and tools.special_markers == special
    assert dict(tools.special_ids) == ({m: i for i, m in TOOL_MARKERS.items()} if special else {})
    assert tools.sampling_params(None).skip_special_tokens is not special  # kept in the text when special
    assert markers_are_special(tokenizer, tools, ReasoningFormat.for_template(GEMMA4)) == special
    ids_ = tokenizer.encode("Sure. " + ROME)
    kept = tokenizer.decode(ids_, skip_special_tokens=False)  # the text the parser sees
    assert parse_tool_calls(kept, G, tool_parameters=PARAMETERS).tool_calls[0].name == "get_weather"


def accepts(backend: GrammarBackend, grammar: str, text: str) -> bool:
    compiled, _ = backend.compile(StructuredOutputsParams(grammar=grammar))
    matcher = compiled.matcher.deep_copy()
    return all(matcher.consume_token(t) for t in backend.tokenizer.encode(text)) and matcher.is_accepting()


def grammar_of(tokenizer: Tokenizer, tool_choice: Any, *, parallel: bool = True) -> str:
    enforced = ChatTools.build(TOOLS, tool_choice, tokenizer, parallel_tool_calls=parallel).enforced()
    assert enforced is not None and enforced.grammar is not None
    return enforced.grammar


def test_the_grammar_accepts_exactly_valid_calls(tokenizer: Tokenizer, backend: GrammarBackend) -> None:
    required, single = grammar_of(tokenizer, "required"), grammar_of(tokenizer, "required", parallel=False)
    named = grammar_of(tokenizer, {"type": "function", "function": {"name": "get_time"}})
    special = bool(tokenizer.special_ids & set(TOOL_MARKERS))
    assert ("<[12]>" in required) == special and ('"<|tool_call>"' in required) != special
    # a string may hold the closing marker's text, not a special token (no text lexeme holds one)
    marker = "" if special else CALL_CLOSE
    assert accepts(backend, required, call("get_weather", f"city:{Q}{CALL_CLOSE}{Q}")) != special
    full = call(
        "get_weather",
        f"city:{Q}Rome, {{x}}\n{marker}{Q},days:-3,hot:true,opts:{{a:[1,{Q}x{Q},None,{{k:2.5}}]}},unit:{Q}f{Q}"
        f",version:{Q}{Q}",
    )
    for text in [PARIS, TIME, full, PARIS + TIME, call("get_weather", f"city:{Q}{Q}")]:
        assert accepts(backend, required, text), text
    assert accepts(backend, single, PARIS) and not accepts(backend, single, PARIS + TIME)
    assert accepts(backend, named, TIME) and not accepts(backend, named, PARIS)
    for text in [
        call("get_weather", "days:3"),  # the required city is missing
        call("get_news"),  # not offered
        call("get_weather", f"days:3,city:{Q}Paris{Q}"),  # the template's order: keys sorted
        call("get_weather", f"city:{Q}a{Q}b{Q}"),  # a string cannot hold the marker
        call("get_weather", f"city:{Q}Paris{Q},days:three"),  # an integer is its digits
        call("get_weather", f"city:{Q}Paris{Q},days:3.5"),
        call("get_weather", f"city:{Q}Paris{Q},unit:{Q}k{Q}"),  # not one of the enum's values
        call("get_weather", f"city:{Q}Paris{Q},zone:1"),  # no such parameter
        call("get_weather", f"city:{Q}Paris{Q},opts:{{b:1}}"),  # objects are closed
        call("get_weather", "city:Paris"),  # a string has its markers
        call("get_weather", f"city:{Q}Paris{Q},"),  # no trailing comma
        call("get_weather", f"city:{Q}Paris{Q}, days:3"),  # no whitespace
        "Sure! " + PARIS,
        PARIS + "\n",
    ]:
        assert not accepts(backend, required, text), text
    # whatever the grammar accepts parses back to calls, typed
    assert run(full, [full])[1] == [
        (
            "get_weather",
            f'{{"city": "Rome, {{x}}\\n{marker}", "days": -3, "hot": true, "opts": {{"a": [1, "x", null, {{"k": 2.5}}]}}, '
            '"unit": "f", "version": ""}',
        )
    ]


def test_a_named_function_not_offered_is_refused() -> None:
    with pytest.raises(InvalidParameterError) as err:
        ChatTools.build(TOOLS, {"type": "function", "function": {"name": "get_news"}}, gemma4_tokenizer(4))
    assert err.value.param == "tool_choice"


# ---- the history: tool results where the template reads them ------------------------------------------------
@pytest.mark.parametrize(
    "case", ["tool-call-and-result", "tool-result-then-answer", "tool-history-without-tools"]
)
def test_tool_results_render_as_the_templates_tool_responses(tmp_path: Path, case: str) -> None:
    """The wire form through the server's path (template_messages, ChatTools.template_inputs, render_chat)
    gives transformers' text for the conversation with its `tool` messages rewritten as the calling
    message's tool_responses (tool_responses_for_template): the result as `response:NAME{...}` inside
    the model's turn, not a turn of role "tool"."""
    t = TEMPLATES["gemma4"]
    messages, kwargs = _conversations(t)[case]
    rewritten = tool_responses_for_template(copy.deepcopy(messages))
    assert not any(m["role"] == "tool" for m in rewritten) and rewritten != messages
    want = _reference_tokenizer(t).apply_chat_template(
        rewritten, tools=kwargs.get("tools"), tokenize=False, add_generation_prompt=True
    )
    tokenizer = _model_folder(tmp_path, t)
    body: dict[str, Any] = {
        "messages": _wire(messages),
        **({"tools": kwargs["tools"]} if "tools" in kwargs else {}),
    }
    req = ChatCompletionRequest.model_validate(body)
    rendered, offered = chat_tools(req, tokenizer).template_inputs(template_messages(req.messages))
    got = render_chat(tokenizer, rendered, tools=offered).text
    assert got == want
    result = f"{CALL_CLOSE}<|tool_response>response:get_weather{{temp:21}}<tool_response|>"
    assert result in got and "<|turn>tool" not in got
    if case == "tool-result-then-answer":  # the answer continues the turn that called
        assert result + "21 degrees.<turn|>" in got
    assert ("<|tool>declaration:get_weather" in got) == ("tools" in kwargs)


def test_tool_results_keep_what_is_not_json_and_find_their_call() -> None:
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            {
                "id": "b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
        ],
    }
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        called,
        {"role": "tool", "tool_call_id": "b", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "[12, 30]"}]},
        {"role": "tool", "tool_call_id": "zz", "content": "{}"},
    ]
    out = tool_responses_for_template(messages)
    assert len(out) == 2 and "tool_responses" not in called  # the input is not modified
    assert out[1]["tool_responses"] == [
        {"name": "get_weather", "response": "sunny, 21 C"},
        {"name": "get_time", "response": [12, 30]},
        {"name": "unknown", "response": {}},
    ]
    text = ChatTemplate(GEMMA4, bos_token="<bos>").render(out, add_generation_prompt=True)
    assert (
        f"response:get_weather{{value:{Q}sunny, 21 C{Q}}}" in text
        and "response:get_time{value:[12,30]}" in text
    )
    assert tool_responses_for_template(messages[2:3]) == messages[2:3]  # no call before it: left as it is


# ---- through the server --------------------------------------------------------------------------------------
SERVED_TOOLS: Any = [TOOLS[0]]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def engine_for(tok: Tokenizer) -> Engine:
    model = ScriptedLM()
    mc = model.config
    kv = PagedKVCache(mc.num_hidden_layers, 256, 4, mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu")
    parts = LoadedEngineParts(
        files=resolve_model(None), model_config=mc, model=model, tokenizer=tok,  # type: ignore[arg-type]
        kv_cache=kv, num_blocks=256, max_model_len=2048, device=torch.device("cpu"), dtype=torch.float32,
        load_seconds=0.0,
    )  # fmt: skip
    return Engine(
        EngineConfig(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=2048), parts=parts
    )


def script(engine: Engine, output: str) -> None:
    """The model answers ASK (rendered with the tools, as the server renders it) with `output`, then EOS."""
    tok = engine.tokenizer
    prompt = render_chat(tok, ASK, tools=SERVED_TOOLS)
    assert prompt.text.endswith(
        "<|turn>model\n<|channel>thought\n<channel|>"
    )  # reasoning closed (thinking off)
    assert "<|tool>declaration:get_weather{" in prompt.text
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt.token_ids) + k: t for k, t in enumerate(tok.encode(output))}
    assert EOS not in model.script.values()


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_gemma4_call_through_the_server(tokenizer: Tokenizer, tool_choice: Any) -> None:
    """Content and two calls, whole and streamed; forced, the grammar takes the model's own layout, and
    the arguments stream pair by pair. Both with the markers as text pieces and as special tokens."""
    engine = engine_for(tokenizer)
    forced = tool_choice != "auto"
    rome = call("get_weather", f"city:{Q}Rome, {{Italy}}{Q},days:2")
    output = ("" if forced else "I'll look it up.\n") + PARIS + ("" if forced else rome)
    script(engine, output)
    want = [("get_weather", PARIS_JSON)] + (
        [] if forced else [("get_weather", '{"city": "Rome, {Italy}", "days": 2}')]
    )

    async def test(client: openai.AsyncOpenAI) -> None:
        whole, streamed = await both(
            client, messages=ASK, tools=SERVED_TOOLS, tool_choice=tool_choice, max_tokens=200
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and streamed["finish_reason"] == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == want
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
        content = None if forced else "I'll look it up."
        assert choice.message.content == content and (streamed["content"] or None) == content

    serve(engine, test)
    if forced:  # the arguments came in pieces as they were generated

        async def pieces(client: openai.AsyncOpenAI) -> None:
            stream: Any = await client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=SERVED_TOOLS,
                tool_choice=tool_choice,
                stream=True,
                max_tokens=200,
                temperature=0,
            )
            got = [
                d.function.arguments
                async for c in stream
                for ch in c.choices
                for d in ch.delta.tool_calls or []
            ]
            assert got[0] == "" and len(got) >= 3 and "".join(got) == PARIS_JSON, got

        serve(engine, pieces)


def test_a_history_with_results_reaches_the_model_in_its_own_format(tokenizer: Tokenizer) -> None:
    """A second turn: the client sends the call back as a JSON string and the result as a `tool`
    message; the prompt the model sees holds both in Gemma 4's syntax, inside its own turn."""
    engine = engine_for(tokenizer)
    messages: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS_JSON}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'},
    ]
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": SERVED_TOOLS})
    rendered, offered = chat_tools(req, tokenizer).template_inputs(template_messages(req.messages))
    prompt = render_chat(tokenizer, rendered, tools=offered)
    block = f"{CALL_OPEN}call:get_weather{{city:{Q}Paris{Q},days:3}}{CALL_CLOSE}"
    response = f"<|tool_response>response:get_weather{{sky:{Q}clear{Q},temp:21}}<tool_response|>"
    assert prompt.text.endswith("<|turn>model\n" + block + response + "<|channel>thought\n<channel|>")
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt.token_ids) + k: t for k, t in enumerate(tokenizer.encode("Sunny"))}

    async def test(client: openai.AsyncOpenAI) -> None:
        resp = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=SERVED_TOOLS, max_tokens=5, temperature=0
        )
        # the scripted tokens come right after this prompt, so the server rendered exactly it
        assert resp.choices[0].message.content == "Sunny" and resp.choices[0].finish_reason == "stop"
        assert resp.usage is not None and resp.usage.prompt_tokens == len(prompt.token_ids)

    serve(engine, test)


def test_a_value_nested_too_deep_is_no_call() -> None:
    """Nesting is read up to a bound (the scan is recursive): deeper, the block is content, not a crash."""
    for depth, is_call in ((100, True), (101, False), (5000, False)):
        text = call("get_time", "a:" + "[" * depth + "]" * depth)
        parsed = parse_tool_calls(text, G, tool_names=["get_time"])
        assert (len(parsed.tool_calls) == 1, parsed.content is None) == (is_call, is_call), depth
