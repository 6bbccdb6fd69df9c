"""The lab's prefix_cache experiment on a hybrid model: a tiny random Qwen3.5 saved as a user's folder
(tests/helpers/make_models.py write_tiny_hybrid_chat_folder: the embedded SmolLM2's tokenizer and chat
template, an output head that writes whole words), loaded as `onecall lab --model PATH` loads it, the
experiment run in its quick form.

A hybrid resumes a cache hit only at a snapshot of its linear-attention state (engine/state_slots.py).
Checked from the results (the trace's figures): with the model's own template each later turn resumes
at the previous turn's finish, after its prompt and fed reply tokens, as a model without a state would;
with the qwen3-style template, which rewrites the previous prompt's last tokens (its think block), the
KV match stops there and the state resumes at the last 64-token boundary before it that an earlier
prompt left, else from scratch. The report's hybrid section must say so with those same numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from onecall.lab.runner import LabRun, run_lab
from onecall.llm import LLM
from onecall.text.tokenizer import Tokenizer
from tests.helpers.make_models import write_tiny_hybrid_chat_folder
from tests.helpers.tiny_engine import embedded_tokenizer

pytestmark = pytest.mark.slow

ALIGN, MARGIN = 64, 16  # the engine's aligned snapshot (onecall/engine/state_slots.py)


def aligned(num_prompt_tokens: int) -> int:
    """The aligned snapshot of a prompt: the last multiple of ALIGN at least MARGIN tokens before its end."""
    return max(num_prompt_tokens - 1 - MARGIN, 0) // ALIGN * ALIGN


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hybrid_chat_folder(tmp_path_factory.mktemp("models") / "tiny-qwen3.5")


@pytest.fixture(scope="module")
def engine_kwargs(folder: Path) -> dict[str, Any]:
    return {"model": str(folder), "num_threads": 1}  # one torch thread: see tests/lab/test_lab.py


@pytest.fixture(scope="module")
def llm(engine_kwargs: dict[str, Any]) -> Iterator[LLM]:
    num_threads = torch.get_num_threads()
    yield LLM(**engine_kwargs)
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def lab(
    llm: LLM, engine_kwargs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[LabRun, dict[str, Any]]:
    out = tmp_path_factory.mktemp("lab")
    run = run_lab(llm, engine_kwargs, out, ["prefix_cache"], quick=True, progress=lambda _: None)
    assert run.ok, {o.name: o.error for o in run.outcomes}
    return run, json.loads(run.results_path.read_text())["prefix_cache"]


def test_the_folder_is_a_hybrid_with_smollm2s_tokenizer_and_template(folder: Path, llm: LLM) -> None:
    info = llm.info
    assert info.model_name == "tiny-qwen3.5" and info.vocab_size == 49152
    assert info.state_bytes_per_sequence > 0 and info.state_snapshots > 0
    ours, embedded = Tokenizer.from_hf_folder(folder), embedded_tokenizer()
    text = "<|im_start|>user\nHow do I link books to authors? 12 tables<|im_end|>\n<think>\n\n</think>"
    assert ours.encode(text) == embedded.encode(text)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos_token) == (1, frozenset({2}), False)
    assert ours.chat_template == embedded.chat_template
    rendered = llm.render([{"role": "user", "content": "hi"}])
    assert rendered.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_hybrid_figures_per_turn(llm: LLM, lab: tuple[LabRun, dict[str, Any]]) -> None:
    res = lab[1]
    info = llm.info
    assert res["hybrid"] == {
        "state_bytes_per_sequence": info.state_bytes_per_sequence,
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "state_snapshots": info.state_snapshots,
        "snapshot_align": ALIGN,
        "snapshot_margin": MARGIN,
    }
    for chat in res["templates"].values():
        turns = chat["turns"]
        assert len(turns) == 4
        for t in turns:
            assert t["num_cached_tokens"] == t["state_resumed_at"] <= t["num_kv_matched_tokens"]
            assert t["num_recomputed_tokens"] == t["num_kv_matched_tokens"] - t["state_resumed_at"]
            assert t["num_cached_tokens"] + t["prefilled_cache_on"] == t["num_prompt_tokens"]
            assert t["prefilled_cache_off"] == t["num_prompt_tokens"]
            assert t["num_reply_tokens"] == res["max_reply_tokens"]  # the helper's model never says EOS
        assert chat["totals"]["recomputed_tokens"] == sum(t["num_recomputed_tokens"] for t in turns)

    # own template: each turn resumes after every token the previous request was fed
    own = res["templates"]["own"]["turns"]
    for prev, t in zip(own, own[1:], strict=False):
        assert t["num_cached_tokens"] == prev["num_prompt_tokens"] + prev["num_reply_tokens"] - 1
        assert t["num_kv_matched_tokens"] == t["num_cached_tokens"] and t["num_recomputed_tokens"] == 0
        assert t["resumed_from"] == {"snapshot": "finish", "turn": prev["turn"]}
        assert t["cause"] == "new turn appended"

    # qwen3-style: the match stops at the think block; the state resumes at a 64-token boundary before it
    block = res["think_block"]["num_tokens"]
    qwen = res["templates"]["qwen3-style"]["turns"]
    for k, t in enumerate(qwen[1:], start=1):
        prev = qwen[k - 1]
        assert t["divergence"]["index"] == t["num_kv_matched_tokens"] == prev["num_prompt_tokens"] - block
        # every earlier prompt's aligned snapshot that lies before its think block is a prefix of this one
        usable = [
            b
            for e in qwen[:k]
            if 0 < (b := aligned(e["num_prompt_tokens"])) <= e["num_prompt_tokens"] - block
        ]
        assert t["state_resumed_at"] == max(usable, default=0)
        if usable and max(usable) == aligned(prev["num_prompt_tokens"]):
            assert t["resumed_from"] == {"snapshot": "aligned", "turn": prev["turn"]}
            assert t["num_recomputed_tokens"] < ALIGN + MARGIN
        elif not usable:
            assert t["resumed_from"] == {"snapshot": "none", "turn": None}
    assert any(t["resumed_from"]["snapshot"] == "aligned" for t in qwen)  # the quick chat passes 64 tokens
    assert any(t["resumed_from"]["snapshot"] == "none" for t in qwen[1:])  # and starts under it


def test_report_explains_the_hybrid_with_its_numbers(llm: LLM, lab: tuple[LabRun, dict[str, Any]]) -> None:
    run, res = lab
    md = (run.out_dir / "report.md").read_text()
    section = md[md.index("### What changes for a hybrid model") :]
    info = llm.info
    assert f"**{info.state_bytes_per_sequence:,} bytes**" in section
    assert f"({info.kv_bytes_per_token:,} bytes per token)" in section
    assert f"keeps **{info.state_snapshots}** snapshots" in section
    assert f"its last multiple of {ALIGN} tokens at least {MARGIN} tokens before its end" in section
    assert f"recomputes fewer than {ALIGN + MARGIN} matched tokens" in section
    assert f"last {res['think_block']['num_tokens']} tokens (the think block)" in section
    for template, chat in res["templates"].items():
        turns, tot = chat["turns"], chat["totals"]
        name = "tiny-qwen3.5's own template" if template == "own" else f"the `{template}` template"
        later = turns[1:]
        recomputed = [t["num_recomputed_tokens"] for t in later]
        paragraph = next(p for p in section.split("\n\n") if p.startswith(f"With {name}, of turns 2-4"))
        assert f"{sum(recomputed)} tokens of their KV match recomputed" in paragraph
        assert f"({', '.join(map(str, recomputed))} per turn)" in paragraph
        assert f"prefilled {tot['prefilled_cache_on']:,} tokens with the cache" in paragraph
        assert f"would prefill {tot['prefilled_cache_on'] - tot['recomputed_tokens']:,}." in paragraph
        if template == "own":
            assert "at the previous turn's finish in 3 (turns 2, 3, 4):" in paragraph
        else:
            # in the quick chat: from scratch, then at the previous prompt's boundary (checked above)
            assert all(t["resumed_from"]["turn"] in (None, t["turn"] - 1) for t in later)
            boundary = f"at the previous prompt's last {ALIGN}-token boundary"
            for snapshot, said in (("none", "from scratch"), ("aligned", boundary)):
                ks = [t["turn"] for t in later if t["resumed_from"]["snapshot"] == snapshot]
                numbers = ("turn " if len(ks) == 1 else "turns ") + ", ".join(map(str, ks))
                assert f"{said} in {len(ks)} ({numbers})" in paragraph
        # the table: KV match, where the state resumed, and why the hit is shorter
        table = md[md.index(f"### With {name}") :]
        assert "| turn | prompt | KV match | cached (state resumed at) | resumed from |" in table
        for t in turns:
            cells = (t["turn"], t["num_prompt_tokens"], t["num_kv_matched_tokens"], t["state_resumed_at"])
            assert "| " + " | ".join(map(str, cells)) + " | " in table
            if t["num_recomputed_tokens"]:
                assert (
                    f"no snapshot between {t['state_resumed_at']} and {t['num_kv_matched_tokens']}, "
                    f"{t['num_recomputed_tokens']} token" in table
                )
        assert f"**{tot['recomputed_tokens']:,}** were in the KV match" in table
    row = next(r for r in md.splitlines() if r.startswith("| prefix_cache | hybrid: KV-matched tokens"))
    own, qwen = (res["templates"][n]["totals"]["recomputed_tokens"] for n in ("own", "qwen3-style"))
    assert f"| {own:,} / {qwen:,} |" in row
