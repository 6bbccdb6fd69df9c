"""The grammars over harmony's channels (tools/harmony_grammar.py), compiled by llguidance for
gpt-oss's real ids and bytes (tests/helpers/harmony_tokenizer.py) and fed token by token: which
harmony outputs each accepts (whole, to its stop token) and which it rejects."""

from __future__ import annotations

import pytest

pytest.importorskip("openai_harmony")
pytestmark = pytest.mark.slow  # builds gpt-oss's 200k-token tokenizer (~3 s a process)

from onecall.errors import InvalidParameterError  # noqa: E402
from onecall.sampling.grammar import GrammarBackend  # noqa: E402
from onecall.sampling_params import StructuredOutputsParams  # noqa: E402
from onecall.text.harmony import harmony_encoding  # noqa: E402
from onecall.tools.harmony_grammar import (  # noqa: E402
    analysis_budget,
    harmony_call_grammar,
    harmony_final_grammar,
)
from tests.helpers.harmony_tokenizer import harmony_bytes_tokenizer  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
THINK = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
CALL_IN_ROLE = " to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    return GrammarBackend(harmony_bytes_tokenizer())


def accepts(backend: GrammarBackend, grammar: str, completion: str) -> bool:
    """Does the grammar take every token of `completion` and accept at its end?"""
    compiled, _ = backend.compile(StructuredOutputsParams(grammar=grammar))
    matcher = compiled.matcher.deep_copy()
    ids = harmony_encoding().encode(completion, allowed_special="all")
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "completion, ok",
    [
        (THINK + CALL, True),  # reasoning, then the call in the channel header
        (CALL, True),  # no reasoning
        (CALL_IN_ROLE, True),  # the recipient in the role header, as openai-harmony renders a call
        ("<|channel|>final<|message|>Sunny.<|return|>", False),  # an answer is not a call
        (CALL.replace('"Paris"}', '"Paris", "x": 1}'), False),  # an invented argument
        (CALL.replace("get_weather", "get_news"), False),  # a function not offered
        (CALL.replace("<|call|>", "<|end|>"), False),  # a call ends in <|call|>
    ],
)
def test_required_call(backend: GrammarBackend, completion: str, ok: bool) -> None:
    assert accepts(backend, harmony_call_grammar(TOOLS, None, analysis_tokens=64), completion) is ok


def test_named_call_takes_that_function_only(backend: GrammarBackend) -> None:
    grammar = harmony_call_grammar(TOOLS, "get_time", analysis_tokens=64)
    assert accepts(backend, grammar, CALL_IN_ROLE)
    assert not accepts(backend, grammar, CALL)
    with pytest.raises(InvalidParameterError) as err:
        harmony_call_grammar(TOOLS, "get_news", analysis_tokens=64)
    assert err.value.param == "tool_choice"


def test_analysis_is_bounded(backend: GrammarBackend) -> None:
    """At most `analysis_tokens` tokens of analysis text (here " word" is one token each); none at 0."""
    grammar = harmony_call_grammar(TOOLS, None, analysis_tokens=10)
    think = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"
    assert accepts(backend, grammar, think.format(" word" * 10) + CALL)
    assert not accepts(backend, grammar, think.format(" word" * 11) + CALL)
    assert not accepts(backend, harmony_call_grammar(TOOLS, None, analysis_tokens=0), THINK + CALL)
    assert analysis_budget(80) == 40 and analysis_budget(1) == 0


@pytest.mark.parametrize(
    "so, body, ok",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}), '{"a": 12}', True),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}), '{"a": "x"}', False),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}), '{"b": 1}', False),
        (StructuredOutputsParams(json_object=True), '{"b": [1, 2]}', True),
        (StructuredOutputsParams(regex="[0-9]+/[0-9]+"), "3/4", True),
        (StructuredOutputsParams(regex="[0-9]+/[0-9]+"), "3-4", False),
        (StructuredOutputsParams(choice=["yes", "no"]), "no", True),
        (StructuredOutputsParams(choice=["yes", "no"]), "maybe", False),
    ],
)  # fmt: skip
def test_final_message(backend: GrammarBackend, so: StructuredOutputsParams, body: str, ok: bool) -> None:
    grammar = harmony_final_grammar(so, "response_format", analysis_tokens=64)
    final = f"<|channel|>final<|message|>{body}<|return|>"
    assert accepts(backend, grammar, THINK + final) is ok
    assert accepts(backend, grammar, final) is ok
    assert not accepts(backend, grammar, CALL)


def test_a_lark_grammar_cannot_be_nested() -> None:
    with pytest.raises(InvalidParameterError) as err:
        harmony_final_grammar(
            StructuredOutputsParams(grammar='start: "x"'), "structured_outputs", analysis_tokens=8
        )
    assert err.value.param == "structured_outputs"
