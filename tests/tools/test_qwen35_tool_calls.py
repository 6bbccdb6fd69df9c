"""Qwen3.5's XML tool calls (tools/xml_calls.py, ToolFormat.XML): detection from the real template, the
parser whole and streamed (the same content and calls for every way of cutting the output), values typed
by the function's schema, malformed input, the forced-call grammar (compiled by GrammarBackend on the
embedded model's real tokenizer and fed its tokens), the history's calls rendered as transformers renders
them and parsed back, and a call through the server (in-process, the official openai client) from a
scripted model under the real Qwen3.5 template."""

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
from onecall.server.serving_tools import chat_tools
from onecall.text.chat_template import render_chat
from onecall.text.tokenizer import Tokenizer
from onecall.tools.calling import ChatTools
from onecall.tools.calls import ToolCallParser, assemble_tool_calls, parse_tool_calls
from onecall.tools.specs import ToolFormat
from onecall.tools.xml_calls import scan_call, value_from_text
from tests.helpers.tiny_engine import embedded_tokenizer
from tests.helpers.tool_streams import call_ids, splits, stream_parse
from tests.system.test_server_reasoning import EOS, MARKERS, MODEL, ScriptedLM, both, serve
from tests.text.test_chat_templates_real import TEMPLATES, _reference_tokenizer

DATA = Path(__file__).parent.parent / "data" / "chat_templates"
QWEN35 = (DATA / "Qwen-Qwen3.5.jinja").read_text(encoding="utf-8")
X = ToolFormat.XML

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "hot": {"type": "boolean"},
        "opts": {"type": "object", "properties": {"a": {"type": "array"}}},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city"],
}
TIME_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


def xml_call(name: str, **params: str) -> str:
    """A call as the template writes one (values given as the text to write)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = xml_call("get_weather", city="Paris", days="3")
ROME = xml_call("get_weather", city="Rome\nItaly", hot="true", opts='{"a": [1, "x"]}')
TIME = xml_call("get_time")

# output -> (content, [(name, arguments_json)])
CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (PARIS, None, [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("Let me check.\n\n" + PARIS, "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    (
        PARIS + "\n" + ROME + "\n" + TIME,
        None,
        [
            ("get_weather", '{"city": "Paris", "days": 3}'),
            ("get_weather", '{"city": "Rome\\nItaly", "hot": true, "opts": {"a": [1, "x"]}}'),
            ("get_time", "{}"),
        ],
    ),
    # a value may hold look-alike tags: the structure decides; "</tool_call>" in a value ends the block
    (
        xml_call("get_weather", city="a </function> <parameter=x>"),
        None,
        [("get_weather", '{"city": "a </function> <parameter=x>"}')],
    ),
    (
        xml_call("get_weather", city="a </tool_call> b") + " ok",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na </tool_call> b\n</parameter>\n</function>\n"
        "</tool_call> ok",
        [],
    ),
    ("No call here, just <b>text</b>.", "No call here, just <b>text</b>.", []),
    # malformed: a closed block that is not a call stays content, as the hermes parser keeps bad JSON
    (
        "<tool_call>\n<function=get_news>\n</function>\n</tool_call>",  # a function not offered
        "<tool_call>\n<function=get_news>\n</function>\n</tool_call>",
        [],
    ),
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call> ok",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call> ok",
        [],
    ),  # a parameter never closed
    (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' + TIME,
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        [("get_time", "{}")],
    ),  # hermes JSON is not this format
    # unclosed at the end: a call cut short (max_tokens) is dropped, as the hermes parser drops one;
    # a complete function whose "</tool_call>" never came still counts
    ("Checking.\n" + PARIS[:-30], "Checking.", []),
    ("Checking.\n" + PARIS[: -len("\n</tool_call>")], "Checking.", [("get_weather", '{"city": "Paris", "days": 3}')]),
]  # fmt: skip


def run(
    text: str, pieces: list[str], *, stream_arguments: bool = False
) -> tuple[str | None, list[tuple[str, str]]]:
    return stream_parse(X, PARAMETERS, text, pieces, stream_arguments=stream_arguments)


def test_the_real_templates_choose_their_format() -> None:
    assert ToolFormat.for_template(QWEN35) == X
    assert (
        ToolFormat.for_template((DATA / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
        == ToolFormat.HERMES
    )
    assert ToolFormat.for_template(None) == ToolFormat.JSON


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_whole_text(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed = parse_tool_calls(text, X, tool_parameters=PARAMETERS)
    assert (parsed.content, [(c.name, c.arguments_json) for c in parsed.tool_calls]) == (content, calls)
    untyped = parse_tool_calls(text, X, tool_names=list(PARAMETERS))  # no schemas: every value a string
    assert [c.name for c in untyped.tool_calls] == [name for name, _ in calls]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_split_streams_the_same(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(text):
        assert run(text, pieces) == (content, calls), pieces


def test_text_that_may_become_a_call_is_held_back() -> None:
    parser = ToolCallParser(X, tool_parameters=PARAMETERS, new_id=call_ids())
    assert parser.feed("Sure. <tool_").content == "Sure."
    out = parser.feed("call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert out.content == "" and out.tool_calls == []  # auto: held until the call is complete


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("3", {"type": "string"}, "3"),  # a string stays a string
        ("null", {"type": "string"}, "null"),
        ("3", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),  # not an integer: the text
        ("3", {"type": "number"}, 3),
        ("-2.5e3", {"type": "number"}, -2500.0),
        ("true", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),  # the template writes Python's str(False)
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': 1}", {"type": "object"}, "{'a': 1}"),  # not JSON: the text
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("null", {"type": "null"}, None),
        ("None", {"type": ["integer", "null"]}, None),
        ("7", {"type": ["string", "integer"]}, 7),
        ("7a", {"type": ["string", "integer"]}, "7a"),
        ("c", {"enum": ["c", "f"]}, "c"),
        ("2", {"enum": [1, 2]}, 2),
        ("2", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 2),
        ("42", None, "42"),  # a parameter the schema does not name
        ("42", {"description": "no type"}, "42"),
    ],
)
def test_values_are_typed_by_schema(text: str, schema: Any, value: Any) -> None:
    got = value_from_text(text, schema)
    assert got == value and type(got) is type(value)


def test_unknown_parameters_stay_strings_and_a_repeat_keeps_the_first() -> None:
    text = xml_call("get_weather", city="Paris", extra="12", days="2") + ""
    text = text.replace("</function>", "<parameter=days>\n9\n</parameter>\n</function>")
    assert run(text, [text]) == (None, [("get_weather", '{"city": "Paris", "extra": "12", "days": 2}')])


def test_scan_tells_a_prefix_from_text_that_cannot_be_a_call() -> None:
    body = PARIS[len("<tool_call>") :]
    for i in range(len(body)):
        assert scan_call(body[:i], "</tool_call>", PARAMETERS).state == "partial", body[:i]
    assert scan_call(body, "</tool_call>", PARAMETERS).state == "complete"
    for bad in [
        "\nhello",
        "\n<function=get_news>",
        "\n<function=get_weather>\nx",
        "\n<function=get_weather>\n</function>x",
    ]:
        assert scan_call(bad, "</tool_call>", PARAMETERS).state == "invalid", bad


# ---- streamed arguments (grammar-constrained output) ---------------------------------------------------
def test_constrained_calls_stream_parameter_by_parameter() -> None:
    """Under a grammar each call's head goes out once "<function=NAME>" is written and its arguments a
    parameter at a time; the pieces add up to the same calls for every split."""
    text = PARIS + "\n" + ROME + "\n" + TIME
    expected = run(text, [text])
    for pieces in splits(text):
        assert run(text, pieces, stream_arguments=True) == expected
    parser = ToolCallParser(X, tool_parameters=PARAMETERS, new_id=call_ids(), stream_arguments=True)
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    first = [p for d in deltas for p in d.tool_calls if p.index == 0]
    assert first[0].name == "get_weather" and first[0].id and first[0].arguments == ""
    assert [p.arguments for p in first[1:]] == ["{", '"city": "Paris"', ', "days": 3', "}"]


def test_a_constrained_call_cut_short_stays_partial() -> None:
    text = PARIS[: PARIS.index("<parameter=days>") + 5]
    assert run(text, list(text), stream_arguments=True) == (None, [("get_weather", '{"city": "Paris"')])


# ---- the forced-call grammar ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(embedded_tokenizer())


def accepts(backend: GrammarBackend, grammar: str, text: str) -> bool:
    compiled, _ = backend.compile(StructuredOutputsParams(grammar=grammar))
    matcher = compiled.matcher.deep_copy()
    return all(matcher.consume_token(t) for t in backend.tokenizer.encode(text)) and matcher.is_accepting()


def grammar_of(tool_choice: Any, *, parallel: bool = True) -> str:
    tools = ChatTools.build(TOOLS, tool_choice, embedded_tokenizer(), parallel_tool_calls=parallel)
    assert tools.format == ToolFormat.JSON  # the embedded template: force xml for the grammar
    tools = ChatTools(tools.choice, X, tools.tools, tools.parallel, special_markers=False)
    enforced = tools.enforced()
    assert enforced is not None and enforced.grammar is not None
    return enforced.grammar


def test_the_grammar_accepts_exactly_valid_calls(backend: GrammarBackend) -> None:
    required, single = grammar_of("required"), grammar_of("required", parallel=False)
    named = grammar_of({"type": "function", "function": {"name": "get_time"}})
    full = xml_call(
        "get_weather", city="Rome\n</param", days="3", hot="true", opts='{"a": [1, "x"]}', unit="f"
    )
    ok = [
        PARIS,
        TIME,
        full,
        PARIS + "\n" + TIME,
        PARIS + "\n",
        "\n\n" + PARIS,
        xml_call("get_weather", city=""),
    ]
    for text in ok:
        assert accepts(backend, required, text), text
    assert accepts(backend, single, PARIS) and not accepts(backend, single, PARIS + "\n" + TIME)
    assert accepts(backend, named, TIME) and not accepts(backend, named, PARIS)
    for text in [
        xml_call("get_weather", days="3"),  # the required city is missing
        xml_call("get_news"),  # not offered
        xml_call("get_weather", city="a</parameter>b"),  # a string cannot hold </parameter>
        xml_call("get_weather", city="a</tool_call>b"),  # nor </tool_call>
        xml_call("get_weather", city="Paris", days="three"),  # an integer is its JSON
        xml_call("get_weather", city="Paris", days="3.5"),
        xml_call("get_weather", city="Paris", unit="k"),  # not one of the enum's values
        xml_call("get_weather", city="Paris", opts='{"b": 1}'),  # objects are closed
        xml_call("get_weather", city="Paris", zone="x"),  # no such parameter
        xml_call("get_weather", days="3", city="Paris"),  # schema order
        "Sure! " + PARIS,
        "\n\n\n" + PARIS,  # two newlines at most before the call
        PARIS + "\n\n",
        PARIS.replace("\n</parameter>", "</parameter>"),  # the layout's newline
    ]:
        assert not accepts(backend, required, text), text
    # whatever the grammar accepts parses back to calls, with typed values
    assert run(full, [full])[1] == [
        (
            "get_weather",
            '{"city": "Rome\\n</param", "days": 3, "hot": true, "opts": {"a": [1, "x"]}, "unit": "f"}',
        )
    ]


def test_special_marker_grammar_compiles() -> None:
    tools = ChatTools.build(TOOLS, "required", embedded_tokenizer())
    grammar = ChatTools(tools.choice, X, tools.tools, True, special_markers=True).enforced()
    assert grammar is not None and grammar.grammar is not None
    assert "<tool_call> " in grammar.grammar and '"<tool_call>"' not in grammar.grammar
    llguidance = pytest.importorskip("llguidance")
    assert (
        llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar.grammar)) == ""
    )


def test_a_named_function_not_offered_is_refused() -> None:
    with pytest.raises(InvalidParameterError) as err:
        ChatTools.build(TOOLS, {"type": "function", "function": {"name": "get_news"}}, embedded_tokenizer())
    assert err.value.param == "tool_choice"


# ---- the history: rendered as transformers renders it, and parsed back ---------------------------------
HISTORY_ARGS = {"city": "Paris", "days": 3, "hot": True, "opts": {"a": [1, "x"]}}


def test_history_calls_render_as_transformers_and_parse_back(tmp_path: Path) -> None:
    """The wire form (arguments a JSON string) through the server's path (template_messages, then
    ChatTools.template_inputs and render_chat) gives transformers' text for the same conversation with
    the arguments as an object; the call it renders parses back to the same arguments."""
    from tests.text.test_chat_templates_real import _model_folder

    t = TEMPLATES["qwen3.5"]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": HISTORY_ARGS},
    }
    messages: Any = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    want: Any = _reference_tokenizer(t).apply_chat_template(
        copy.deepcopy(messages), tools=list(TOOLS), tokenize=False, add_generation_prompt=True
    )
    wire = copy.deepcopy(messages)
    wire[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(HISTORY_ARGS)
    req = ChatCompletionRequest.model_validate({"messages": wire, "tools": TOOLS})
    tokenizer = _model_folder(tmp_path, t)
    tools = chat_tools(req, tokenizer)
    assert tools.format == X
    rendered, offered = tools.template_inputs(template_messages(req.messages))
    got = render_chat(tokenizer, rendered, tools=offered).text
    assert got == want
    turn = got.index("<|im_start|>assistant")  # the system turn shows the format with an example call
    block = got[got.index("<tool_call>", turn) : got.index("</tool_call>", turn) + len("</tool_call>")]
    parsed = parse_tool_calls(block, X, tool_names=["get_weather"])
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    typed = ToolCallParser(X, tool_parameters=PARAMETERS)
    deltas = [typed.feed(block), typed.finish()]
    assert json.loads(assemble_tool_calls(deltas)[0].arguments_json) == HISTORY_ARGS


# ---- through the server ------------------------------------------------------------------------------
SERVED_TOOLS: Any = [TOOLS[0]]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def qwen35_tokenizer() -> Tokenizer:
    metadata = dict(open_gguf(resolve_model(None).path).metadata)
    tokens, types = list(metadata["tokenizer.ggml.tokens"]), list(metadata["tokenizer.ggml.token_type"])
    for i, marker in MARKERS.items():
        tokens[i], types[i] = marker, 4  # user-defined: matched whole, kept in the text
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    metadata["tokenizer.chat_template"] = QWEN35
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def engine() -> Engine:
    tok, model = qwen35_tokenizer(), ScriptedLM()
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
    assert prompt.text.endswith("<|im_start|>assistant\n<think>\n")  # Qwen3.5 opens the reasoning
    model = engine.parts.model
    assert isinstance(model, ScriptedLM)
    model.script = {len(prompt.token_ids) + k: t for k, t in enumerate(tok.encode(output))}
    assert EOS not in model.script.values()


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_qwen35_call_through_the_server(engine: Engine, tool_choice: Any) -> None:
    """Reasoning, content and an XML call, whole and streamed; forced, the grammar (after </think>)
    takes the model's own layout and the arguments stream parameter by parameter."""
    forced = tool_choice != "auto"
    call = xml_call("get_weather", city="Paris", days="3")
    # forced, the grammar takes over after "</think>" and lets the template's "\n\n" through
    output = "Let me check.\n</think>\n\n" + ("" if forced else "I'll look it up.\n\n") + call
    script(engine, output)

    async def test(client: openai.AsyncOpenAI) -> None:
        whole, streamed = await both(
            client, messages=ASK, tools=SERVED_TOOLS, tool_choice=tool_choice, max_tokens=200
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and streamed["finish_reason"] == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == [("get_weather", '{"city": "Paris", "days": 3}')]
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
        assert (choice.message.model_extra or {}).get("reasoning_content") == "Let me check."
        assert streamed["reasoning"] == "Let me check."
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
            assert got[0] == "" and len(got) >= 3 and "".join(got) == '{"city": "Paris", "days": 3}', got

        serve(engine, pieces)
