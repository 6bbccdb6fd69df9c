"""The lab's experiments 4-7 (prefill_decode, sampling, json, tools) in quick mode on the embedded model.

Each runs through its module's run(ctx) exactly as `onecall lab` calls it, with one LLM shared by
the module, and the checks are on the figures it returns, not only their presence:

    prefill_decode  prefill beats decode at every length; nothing came from the prefix cache;
                    decode bandwidth positive and below 10x the copy bandwidth measured beside it
    sampling        ten probabilities per T summing to <= 1, sharper at low T; entropy rising with T
    json            no json.loads failure under the grammar; masked + allowed = vocabulary at step 1
    tools           the forced call parses, names get_weather with a valid city; a non-empty answer
Every result must be JSON-serializable and every plot a PNG under out_dir.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from onecall import LLM
from onecall.lab.base import ExperimentResult, LabContext
from onecall.lab.experiments import json_exp, prefill_decode, sampling, tools

pytestmark = pytest.mark.slow

QUICK_CALLS = 3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def run_quick(module: ModuleType, llm: LLM, out_dir: Path) -> ExperimentResult:
    ctx = LabContext(
        llm=llm, engine_kwargs={}, out_dir=out_dir, calls=QUICK_CALLS, quick=True, progress=lambda _: None
    )
    result: ExperimentResult = module.run(ctx)
    # what every experiment owes the report
    assert result.name == module.NAME and result.title == module.TITLE
    json.dumps(result.results, allow_nan=False)  # results.json must take it as it is: plain, finite
    assert result.seed_rows and all(row.figure and row.seed and row.ours for row in result.seed_rows)
    assert result.markdown.strip()
    assert result.plots
    for plot in result.plots:
        assert plot.is_relative_to(out_dir) and plot.read_bytes().startswith(PNG_MAGIC), plot
    assert not llm.engine.has_unfinished_requests()
    return result


def test_prefill_decode(llm: LLM, tmp_path: Path) -> None:
    r = run_quick(prefill_decode, llm, tmp_path).results
    runs = r["runs"]
    assert [run["prompt_tokens"] for run in runs] == list(prefill_decode.QUICK_LENGTHS)
    for run in runs:
        assert run["num_cached_tokens"] == 0 and run["num_prefilled_tokens"] == run["prompt_tokens"]
        assert run["decode_steps"] == r["output_tokens"] - 1  # the first token comes from the prefill
        assert run["prefill_tokens_per_s"] > run["decode_tokens_per_s"] > 0
        assert 0 < run["decode_gb_per_s"] < 10 * r["copy_gb_per_s"]
        assert run["bytes_per_decode_step"] > r["weight_bytes_per_step"] > 0  # plus the KV read
    assert r["ratio"] > 1 and r["ratio_prompt_tokens"] == 256


def test_sampling(llm: LLM, tmp_path: Path) -> None:
    r = run_quick(sampling, llm, tmp_path).results
    rows = r["temperatures"]
    assert [row["temperature"] for row in rows] == list(sampling.TEMPERATURES)
    assert len(r["tokens"]) == len(r["token_ids"]) == sampling.NUM_SHOWN
    for row in rows:
        # float32 softmax: a sum may pass 1 by rounding (4.5e-6 seen at T = 0.2)
        assert all(0 <= p <= 1 for p in row["probs"]) and sum(row["probs"]) <= 1 + 1e-4
        assert sum(row["drawn"]) <= 1 + 1e-9
    t1 = rows[sampling.TEMPERATURES.index(1.0)]["probs"]
    assert t1 == sorted(t1, reverse=True)
    # temperature sharpens below 1 and flattens above: the top token's share falls as T rises
    tops = [row["probs"][0] for row in rows]
    assert tops == sorted(tops, reverse=True) and tops[0] > tops[-1]
    entropies = [row["entropy_bits"] for row in rows]
    assert entropies == sorted(entropies) and entropies[0] < entropies[-1]
    for row in rows:  # the draws' mean surprisal estimates the exact entropy (fixed seeds)
        assert (
            abs(row["entropy_estimate_bits"] - row["entropy_bits"]) <= 5 * row["entropy_stderr_bits"] + 0.05
        )


def test_json(llm: LLM, tmp_path: Path) -> None:
    r = run_quick(json_exp, llm, tmp_path).results
    methods, g = r["methods"], r["grammar"]
    assert list(methods) == list(json_exp.METHODS) and r["calls_per_method"] == QUICK_CALLS
    for m in methods.values():
        assert 0 <= m["fenced_parse_when_stripped"] <= m["fenced"] <= QUICK_CALLS
        assert 0 <= m["failures"] <= QUICK_CALLS
    assert methods["grammar"]["failures"] == 0 and methods["grammar"]["cut_by_max_tokens"] == 0
    vocab = llm.engine.model_config.vocab_size
    assert g["vocab_size"] == vocab and g["errors"] == []
    assert g["first_step_allowed"] >= 1 and g["first_step_masked"] == vocab - g["first_step_allowed"]
    assert 0 < g["masked_per_step_mean"] < vocab
    assert g["constrained_steps"] >= QUICK_CALLS * len(
        json_exp.PERSON["required"]
    )  # a token per key, at least


def test_tools(llm: LLM, tmp_path: Path) -> None:
    r = run_quick(tools, llm, tmp_path).results
    assert r["format"] == "json"  # the embedded SmolLM2 template has no tool format
    assert tools.TOOL_NAME in r["rendered_prompt"] and "# Tools" in r["rendered_prompt"]
    assert r["call"]["name"] == "get_weather" and r["arguments_valid"]
    assert json.loads(r["call_text"])["tool_calls"][0]["arguments"] == r["call"]["arguments"]
    assert r["call_finish_reason"] == "stop" and r["api_finish_reason"] == "tool_calls"
    assert r["tool_result"]["role"] == "tool" and r["tool_result"]["content"] in r["second_prompt_added"]
    assert 0 < r["second_cached_tokens"] < r["second_prompt_tokens"]  # the first prompt's prefix, re-used
    assert r["final_answer"].strip() and r["final_finish_reason"] in ("stop", "length")
    calls = r["calls"]
    assert len(calls) == 2 + r["final_tools_withdrawn"]
    assert all(0 <= c["cached_tokens"] < c["prompt_tokens"] and c["output_tokens"] > 0 for c in calls)
