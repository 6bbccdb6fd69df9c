"""Structured outputs end to end on the embedded model (SmolLM2-135M-Instruct), through LLM.chat.

(a) JSONSchemaBench's Glaive split (function-call argument schemas): 200 of them,
    sampled deterministically. Each must either compile, or be refused with an
    InvalidParameterError naming structured_outputs.json; every output that
    finished ("stop") must json.loads and validate with `jsonschema` against
    the schema as written, and most must finish within max_tokens.
(b) The seed's JSON experiment: a naive "reply in JSON" prompt, a strict system
    prompt and the grammar, 20 sampled calls each (temperature 0.7, seeded).
    json.loads failures are counted and printed; the grammar run must have none.
(c) LLM.generate with a regex and a choice, and an enforced tool call (the
    json convention's schema from tools/specs.py) whose arguments validate.

(a) and (b) run as one batch each (the engine keeps up to 64 sequences running).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from onecall import LLM, SamplingParams
from onecall.errors import InvalidParameterError
from onecall.lab.experiments import json_exp
from onecall.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # every test runs the embedded model (`llm`, tests/conftest.py)

BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench-glaiveai2k.jsonl"
NUM_SCHEMAS = 200


def load_schemas() -> list[dict[str, Any]]:
    if not BENCH.is_file():
        pytest.skip(f"{BENCH} is not here")
    rows = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
    return random.Random(0).sample(rows, NUM_SCHEMAS)


def validates(text: str, schema: dict[str, Any]) -> bool:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError:
        return False
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    return not list(validator.iter_errors(instance))


def test_jsonschemabench_outputs_validate(llm: LLM) -> None:
    rows = load_schemas()
    # 1. compile: a refusal must be a typed error naming the parameter, never a crash
    compiled: list[dict[str, Any]] = []
    refused: list[str] = []
    for row in rows:
        try:
            llm.engine.grammar.compile(StructuredOutputsParams(json=row["schema"]))
            compiled.append(row)
        except InvalidParameterError as e:
            assert e.param == "structured_outputs.json" and str(e).strip()
            refused.append(str(e)[:90])

    # 2. generate, one batch with a schema per request
    conversations = [
        [{"role": "user", "content": f"Call {row['id'].rsplit('_', 1)[0]} with example arguments, as JSON."}]
        for row in compiled
    ]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=row["schema"])
        )
        for row in compiled
    ]
    t0 = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - t0

    # 3. every finished output validates against the schema as written
    finished = [(row, out) for row, out in zip(compiled, outputs, strict=True) if out.finish_reason == "stop"]
    invalid = [(row["id"], out.text) for row, out in finished if not validates(out.text, row["schema"])]
    num_tokens = sum(len(out.token_ids) for out in outputs)
    print(
        f"\njsonschemabench: {len(rows)} schemas, {len(compiled)} compiled, {len(finished)} finished, "
        f"{len(finished) - len(invalid)} validated; {num_tokens} tokens in {seconds:.1f} s"
    )
    for reason in sorted(set(refused)):
        print(f"  not compiled ({refused.count(reason)}): {reason}")
    assert not invalid, invalid[:3]
    assert len(compiled) >= 0.9 * len(rows)
    # the rest ran into max_tokens, mostly repeating array items or characters (a 135M model, greedy):
    # 137 of 194 finished when this was written
    assert len(finished) >= 0.6 * len(compiled)
    assert all(out.trace.grammar is not None and out.trace.grammar.error is None for out in outputs)


def test_seed_json_experiment(llm: LLM) -> None:
    n = 20
    runs = json_exp.METHODS  # the prompts and schema of the lab's json experiment
    conversations = [messages for messages, _ in runs.values() for _ in range(n)]
    params = [
        SamplingParams(temperature=0.7, seed=seed, max_tokens=96, structured_outputs=so)
        for _, so in runs.values()
        for seed in range(n)
    ]
    outputs = llm.chat(conversations, params)  # the 60 calls run as one batch
    failures = {}
    for k, name in enumerate(runs):
        texts = [out.text for out in outputs[k * n : (k + 1) * n]]
        failures[name] = sum(not json_exp.parses(t) for t in texts)
        print(f"\n{name}: json.loads failed {failures[name]} of {n}; e.g. {texts[0][:70]!r}")
    grammar_outputs = outputs[2 * n :]
    assert failures["grammar"] == 0
    assert all(o.finish_reason == "stop" and validates(o.text, json_exp.PERSON) for o in grammar_outputs)
    first = next(s for s in grammar_outputs[0].trace.steps if s.token_id is not None)
    print(f"grammar, first step: {first.num_allowed:,} allowed, {first.num_masked:,} of 49,152 masked")
    assert first.num_allowed is not None and first.num_masked >= 49_000


def test_llm_generate_with_regex_and_choice(llm: LLM) -> None:
    date = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
    )
    yes_no = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    a, b = llm.generate(["The date today is", "Is the sky blue? Answer:"], [date, yes_no])
    assert a.finish_reason == "stop" and len(a.text) == 10 and a.text.startswith("20")
    assert b.finish_reason == "stop" and b.text in ("yes", "no")
    with pytest.raises(InvalidParameterError, match="structured_outputs.regex"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(unclosed"}))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]


@pytest.mark.parametrize("required_name", [None, "get_time"])
def test_enforced_tool_call_is_a_valid_call(llm: LLM, required_name: str | None) -> None:
    """The bridge to tool calling: tool_choice "required" / a named function, as a JSON Schema the
    grammar enforces (the json convention of tools/specs.py for a template with no tool format)."""
    from onecall.tools.specs import messages_for_json_tools, tool_call_schema

    messages = messages_for_json_tools([{"role": "user", "content": "What's the weather in Rome?"}], TOOLS)
    so = StructuredOutputsParams(json=tool_call_schema(TOOLS, required_name=required_name))
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=so))[0]
    assert out.finish_reason == "stop", out.text
    calls = json.loads(out.text)["tool_calls"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["name"] == (required_name or call["name"]) and call["name"] in params
        jsonschema.validate(call["arguments"], params[call["name"]])
