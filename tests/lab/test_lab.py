"""The lab on the embedded model: experiments 1-3 in quick form, the runner, the report and the CLI.

One LLM is loaded for the module and one lab run (memory, prefix_cache, template, quick) writes into
a temporary folder; the tests read its results.json and reports. What the model says is not
asserted (a 135M model's answers are what they are); the structure, the cache facts (cached prefill
below re-sent prefill, the qwen3-style template breaking the match by exactly the length of its
think block) and the report's form are: its seed table is the seed rows results.json holds, and
its words name the model that ran. The other experiments' modules are checked against the contract
here and run by their own tests.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from onecall.errors import InvalidParameterError
from onecall.lab.base import ExperimentResult, LabContext, SeedRow
from onecall.lab.experiments import EXPERIMENT_MODULES, EXPERIMENT_NAMES, load_experiment, select_experiments
from onecall.lab.report import markdown_to_html, md_cell, md_table
from onecall.lab.runner import LabRun, run_lab
from onecall.llm import LLM
from onecall.text.templates import get_named_template

pytestmark = pytest.mark.slow

MINE = ["memory", "prefix_cache", "template"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# One torch thread: on a 2-core machine shared with other work, two OpenMP threads spin against each
# other and the quick run takes minutes instead of well under one.
ENGINE_KWARGS: dict[str, Any] = {"num_threads": 1}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    num_threads = torch.get_num_threads()
    yield LLM(**ENGINE_KWARGS)  # sets torch's thread count for the process: restored below
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def lab(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> tuple[LabRun, dict[str, Any]]:
    lines: list[str] = []
    run = run_lab(llm, ENGINE_KWARGS, tmp_path_factory.mktemp("lab"), MINE, quick=True, progress=lines.append)
    assert lines and all(line.startswith("[") or line.startswith("wrote") for line in lines)
    return run, json.loads(run.results_path.read_text())


def test_results_meta(lab: tuple[LabRun, dict[str, Any]]) -> None:
    run, results = lab
    assert run.ok, {o.name: o.error for o in run.outcomes}
    meta = results["meta"]
    assert meta["model"].startswith("SmolLM2-135M") and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["onecall_version"] and meta["date"] and meta["quick"] is True
    assert meta["machine"]["cpu_count"] >= 1 and meta["machine"]["torch_threads"] >= 1
    assert meta["machine"]["gpu"] is None
    assert list(meta["experiments"]) == MINE and list(results) == ["meta", *MINE]
    for entry in meta["experiments"].values():
        assert entry["status"] == "ok" and entry["duration_s"] > 0 and entry["seed_rows"]


def test_memory(lab: tuple[LabRun, dict[str, Any]]) -> None:
    calls = lab[1]["memory"]["calls"]
    assert set(calls) == {"fact", "isolated", "with_history"}
    for call in calls.values():
        assert isinstance(call["answer"], str) and call["contains_port"] == ("5439" in call["answer"])
    # Call 3 re-sends call 1's exchange: its prompt starts with call 1's, which the cache still holds.
    assert calls["with_history"]["num_prompt_tokens"] > calls["fact"]["num_prompt_tokens"]
    assert calls["with_history"]["num_cached_tokens"] >= calls["fact"]["num_prompt_tokens"]


def test_prefix_cache(llm: LLM, lab: tuple[LabRun, dict[str, Any]]) -> None:
    res = lab[1]["prefix_cache"]
    assert res["num_turns"] == 4
    chats = res["templates"]
    for chat in chats.values():
        turns = chat["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3, 4]
        for t in turns:
            assert t["prefilled_cache_off"] == t["num_prompt_tokens"]  # cache off: everything, every turn
            assert t["num_cached_tokens"] + t["prefilled_cache_on"] == t["num_prompt_tokens"]
            assert t["ttft_ms_cache_on"] > 0 and t["ttft_ms_cache_off"] > 0
        for t in turns[1:]:
            assert t["prefilled_cache_on"] < t["prefilled_cache_off"]
        assert chat["totals"]["prefilled_cache_on"] < chat["totals"]["prefilled_cache_off"]

    # own template: each turn reuses everything the previous call left (prompt + reply)
    for t in chats["own"]["turns"][1:]:
        assert t["cause"] == "new turn appended" and t["tokens_lost"] == 0

    # qwen3-style: every later turn breaks exactly the think block's length before the previous prompt's end
    messages = [{"role": "user", "content": "hi"}]
    source = get_named_template("qwen3-style")
    with_block = llm.render(messages, chat_template=source)
    without = llm.render(messages, chat_template=source, chat_template_kwargs={"enable_thinking": True})
    block_len = len(with_block.token_ids) - len(without.token_ids)
    assert block_len > 0
    for t in chats["qwen3-style"]["turns"][1:]:
        d = t["divergence"]
        assert d is not None and t["match_len"] == d["index"]
        assert t["tokens_early"] == block_len and t["tokens_lost"] >= block_len  # + the reply
        assert t["cause"].startswith("template rewrote an earlier turn")
        assert d["cached_token_text"] in "<think>\n\n</think>\n\n"
    assert chats["qwen3-style"]["totals"]["tokens_early_after_turn_1"] == [block_len]
    block = res["think_block"]  # what the report's words about the block come from
    assert block["num_tokens"] == block_len == len(block["tokens"])
    assert block["text"] == "<think>\n\n</think>\n\n"
    assert "".join(block["tokens"]) == block["text"]


def test_template(llm: LLM, lab: tuple[LabRun, dict[str, Any]]) -> None:
    res = lab[1]["template"]
    assert list(res["formats"]) == ["own template", "raw", "llama2 tags"]
    for fmt in res["formats"].values():
        answers = fmt["answers"]
        assert len(answers) == 5
        for a in answers:
            assert a["clean"] == (a["finish_reason"] == "stop" and bool(a["answer"].strip()))
            assert a["num_output_tokens"] <= 32
        assert fmt["num_clean"] == sum(a["clean"] for a in answers)
    att = res["attention"]
    shares = att["control_share_per_layer"]
    assert len(shares) == llm.info.num_hidden_layers
    assert all(0.0 <= s <= 1.0 + 1e-5 for s in shares)
    # position 0 (<|im_start|>) is one of the control positions: its share is part of theirs
    assert att["control_positions"][0] == 0
    assert all(c >= p - 1e-6 for c, p in zip(shares, att["position0_share_per_layer"], strict=True))
    assert att["control_share_mean"] == pytest.approx(sum(shares) / len(shares))
    assert att["peak_share"] == max(shares) and shares[att["peak_layer"]] == att["peak_share"]


def test_report_files(lab: tuple[LabRun, dict[str, Any]]) -> None:
    run, results = lab
    md = (run.out_dir / "report.md").read_text()
    assert "## Seed vs ours" in md
    # the seed table is the seed rows results.json holds: the seed's figures beside ours, one row each
    seed_rows = [(name, r) for name, e in results["meta"]["experiments"].items() for r in e["seed_rows"]]
    assert len(seed_rows) >= len(MINE)
    for name, r in seed_rows:
        cells = [name, r["figure"], r["seed"], r["ours"], r["note"]]
        assert "| " + " | ".join(md_cell(c) for c in cells) + " |" in md
    # the words name what ran: the model, never one written in for the model the lab was tried on
    model = results["meta"]["model"]
    prefix_rows = [r for name, r in seed_rows if name == "prefix_cache"]
    assert model in prefix_rows[0]["note"] and model in prefix_rows[2]["note"]
    assert f"With {model}'s own template" in md
    plots = [p for entry in results["meta"]["experiments"].values() for p in entry["plots"]]
    assert len(plots) == 3
    for name in plots:
        assert (run.out_dir / name).read_bytes()[:8] == PNG_MAGIC
        assert f"]({name})" in md  # relative image links
    page = (run.out_dir / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and "<script" not in page
    assert "<th>seed (Qwen3-8B, A100)</th>" in page


def test_a_failing_experiment_is_recorded_and_the_others_run(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: LabContext) -> ExperimentResult:
        raise RuntimeError("the experiment broke")

    def fine(ctx: LabContext) -> ExperimentResult:
        return ExperimentResult("memory", "Fine", {"value": float("nan")}, [SeedRow("x", "1", "2")])

    fakes = {
        "sampling": types.SimpleNamespace(NAME="sampling", TITLE="Broken", run=broken),
        "memory": types.SimpleNamespace(NAME="memory", TITLE="Fine", run=fine),
    }
    monkeypatch.setattr("onecall.lab.runner.load_experiment", fakes.__getitem__)
    run = run_lab(llm, {}, tmp_path, ["sampling", "memory"], progress=lambda line: None)
    assert not run.ok
    results = json.loads(run.results_path.read_text())
    assert results["meta"]["experiments"]["sampling"]["status"] == "failed"
    assert "RuntimeError: the experiment broke" in results["sampling"]["error"]
    assert results["memory"] == {"value": None}  # NaN is not JSON: stored as null
    md = (tmp_path / "report.md").read_text()
    assert "**Failed**" in md and "the experiment broke" in md and "| memory | x | 1 | 2 |" in md


def test_registry_and_only() -> None:
    assert EXPERIMENT_NAMES == (
        "memory",
        "prefix_cache",
        "template",
        "prefill_decode",
        "sampling",
        "json",
        "tools",
    )
    assert select_experiments(None) == list(EXPERIMENT_NAMES)
    assert select_experiments("template, memory") == ["memory", "template"]  # the registry's order
    with pytest.raises(InvalidParameterError, match="valid names: memory, prefix_cache"):
        select_experiments("memory,nope")
    for name in EXPERIMENT_NAMES:  # every module written so far keeps the contract
        try:
            module = load_experiment(name)
        except ImportError as e:
            assert f"onecall.lab.experiments.{EXPERIMENT_MODULES[name]}" in str(e)
            continue
        assert name == module.NAME and module.TITLE and callable(module.run)


def test_cli_flags_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from onecall.lab.__main__ import main
    from onecall.lab.cli import add_lab_arguments

    parser = argparse.ArgumentParser()
    add_lab_arguments(parser)
    a = parser.parse_args([])
    assert (a.out, a.calls, a.quick, a.only, a.kernels, a.model) == (
        "lab-report",
        20,
        False,
        None,
        "fast",
        None,
    )
    assert main(["--only", "bogus"]) == 2  # before any model is loaded
    assert "unknown experiment 'bogus'" in capsys.readouterr().err


def test_markdown_to_html(tmp_path: Path) -> None:
    (tmp_path / "p.png").write_bytes(PNG_MAGIC + b"rest")
    md = "\n".join(
        [
            "# Title",
            "",
            "A **bold** `a|b` and [link](https://x).",
            "",
            md_table(["a", "b"], [["x | y", "`<|im_end|>`"], ["line\nbreak", 2]]),
            "",
            "- one",
            "- two",
            "",
            "```",
            "<b>raw</b>",
            "```",
            "",
            "![plot](p.png)",
        ]
    )
    page = markdown_to_html(md, tmp_path)
    assert "<h1>Title</h1>" in page and "<strong>bold</strong>" in page and "<code>a|b</code>" in page
    assert '<a href="https://x">link</a>' in page
    assert "<td>x | y</td><td><code>&lt;|im_end|&gt;</code></td>" in page and "<td>line ↵ break</td>" in page
    assert "<ul><li>one</li><li>two</li></ul>" in page
    assert "<pre><code>&lt;b&gt;raw&lt;/b&gt;</code></pre>" in page
    assert 'src="data:image/png;base64,iVBORw0KGgpyZXN0"' in page


def test_qwen3_style_template(llm: LLM) -> None:
    """The think block is written on the generation prompt only; earlier replies keep their answer only."""
    source = get_named_template("qwen3-style")
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = llm.render(messages, chat_template=source)
    assert rendered.text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert rendered.token_ids[0] == llm.tokenizer.encode("<|im_start|>")[0] and rendered.is_control[0]
    thinking = llm.render(messages, chat_template=source, chat_template_kwargs={"enable_thinking": True})
    assert thinking.text.endswith("<|im_start|>assistant\n")
    assert llm.render(messages).text != rendered.text  # without chat_template: the model's own
    with pytest.raises(InvalidParameterError, match="qwen3-style"):
        get_named_template("qwen4")
