"""benchmarks/gpu_check.py on CPU: its correctness sections (the engine with the Triton attention
backend under TRITON_INTERPRET=1 greedy-decodes a tiny random Qwen3 exactly like transformers, i.e.
the CUDA path end to end except the device and the capture), and its fail-soft runner: a section that
raises is recorded with its error and the next ones still run, a section whose prerequisite failed
is skipped with the reason, --max-seconds skips what is left, and a `partial:` line follows every
section."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from onecall.model.decoder import DecoderLM


def _gpu_check() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def _needs_interpreter(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported")


@pytest.mark.parametrize("backend", ["paged", pytest.param("triton", marks=pytest.mark.slow)])
def test_tiny_qwen3_greedy_equals_transformers(backend: str) -> None:
    _needs_interpreter(backend)
    result = _gpu_check().check_tiny_qwen3(torch.device("cpu"), attention_backend=backend, max_tokens=8)
    assert result["attention_backend"] == backend
    assert result["tokens_equal"], result["mismatches"]


@pytest.mark.parametrize("backend", ["paged", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_cached_prefix_chunk_beside_a_decode_row_equals_transformers(backend: str) -> None:
    """The section that checks the static chunk layouts' tokens on a GPU: with "triton" the step with
    the chunk runs on the static buffers here (the layout the GPU captures)."""
    _needs_interpreter(backend)
    result = _gpu_check().check_cached_chunk(torch.device("cpu"), attention_backend=backend, max_tokens=6)
    assert result["tokens_equal"], result["mismatches"]
    assert result["cached_tokens"] == 16
    if backend == "triton":
        assert "decode 1 + chunk 16" in result["graphs"]["chunk_graphs"], result["graphs"]


def test_tiny_qwen3_in_bfloat16_stays_within_its_regret_tolerance() -> None:
    """The bfloat16 section on CPU's reference kernels (Triton's interpreter cannot do bfloat16 dot
    products): the tolerance it states holds where the arithmetic is right."""
    result = _gpu_check().check_tiny_qwen3_bf16(torch.device("cpu"), max_tokens=12)
    assert result["within_tolerance"], result
    assert result["tokens"] == 36 and result["max_regret"] >= 0.0


@pytest.mark.slow
def test_tensor_parallel_check_runs_on_cpu() -> None:
    """The script's tensor-parallel line (2 GPUs over NCCL on a CUDA machine) on CPU over gloo: the
    folder it writes loads, both engines run, and TP=2's greedy tokens equal TP=1's."""
    result = _gpu_check().check_tensor_parallel(torch.device("cpu"), 2, max_tokens=6)
    assert result["tokens_equal"], result
    assert len(result["tp1"]) == 3 and all(len(t) == 6 for t in result["tp1"])


def _lines(out: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The `partial:` records and the final JSON line of a run's stdout."""
    lines = out.strip().splitlines()
    partials = [json.loads(line.removeprefix("partial: ")) for line in lines if line.startswith("partial: ")]
    return partials, json.loads(lines[-1])


def test_a_failing_section_is_recorded_and_the_later_ones_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two injected faults on a small 8B-shaped model: the copy-bandwidth measurement raises, and one
    forward of the decode section raises (the engine fails that step's request and serves on; the
    script raises it as the section's error). The sections after each still report numbers."""
    gpu_check = _gpu_check()

    def broken_copy(device: torch.device) -> float:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(gpu_check, "copy_bandwidth", broken_copy)
    compute_logits, calls = DecoderLM.compute_logits, [0]

    def flaky_logits(self: DecoderLM, hidden: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:  # decode_graphs: its prompt, its first decode step, then this one
            raise ValueError("injected forward failure")
        return compute_logits(self, hidden)

    monkeypatch.setattr(DecoderLM, "compute_logits", flaky_logits)
    sections = "copy_bandwidth,decode_graphs,prefill_1024,graphs"
    argv = [
        "--device",
        "cpu",
        "--layers",
        "1",
        "--hidden",
        "128",
        "--tensor-parallel",
        "0",
        "--sections",
        sections,
    ]
    status = gpu_check.main(argv)
    partials, result = _lines(capsys.readouterr().out)

    assert status == 1  # a section raised
    assert result["sections"] == ["model_8b", "copy_bandwidth", "decode_graphs", "prefill_1024", "graphs"]
    assert result["errors"] == ["copy_bandwidth", "decode_graphs"] and result["skipped"] == []
    assert result["copy_bandwidth"]["error"] == "RuntimeError: injected copy failure"
    assert "broken_copy" in "\n".join(result["copy_bandwidth"]["traceback_tail"])
    decode = result["decode_graphs"]
    assert decode["error"].startswith("StepFailed: ") and "injected forward failure" in decode["error"]
    assert decode["traceback_tail"][-1] == "ValueError: injected forward failure"  # the cause's own
    assert result["model_8b"]["weight_bytes"] > 0
    assert result["prefill_1024"]["prefill_tokens_per_s"] > 0  # the engine served on
    assert "decode_floor_ms" not in result["copy_bandwidth"]
    # one partial line per section, each holding what ran so far; the last equals the final record
    assert [list(p)[3:] for p in partials] == [result["sections"][: i + 1] for i in range(5)]
    assert {k: partials[-1][k] for k in result["sections"]} == {k: result[k] for k in result["sections"]}


def test_prerequisites_and_the_time_budget_skip_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner alone, on stand-in sections: a section whose prerequisite raised is skipped with
    the reason; once --max-seconds is spent, no further section starts."""
    gpu_check = _gpu_check()
    Section = gpu_check.Section

    def boom(b: object) -> dict[str, Any]:
        raise KeyError("no model")

    def slow(b: object) -> dict[str, Any]:
        time.sleep(0.2)
        return {"value": 1.0}

    sections = [
        Section("base", boom),
        Section("dependent", slow, ("base",)),
        Section("independent", slow),
        Section("late", slow),
    ]
    bench = gpu_check.Bench(torch.device("cpu"), 1, 128, 0)
    result = gpu_check.run_all(bench, sections, max_seconds=0.1)
    assert result["base"]["error"] == "KeyError: 'no model'"
    assert result["dependent"]["skipped"].startswith("needs base, which did not run: ")
    assert result["independent"]["value"] == 1.0
    assert result["late"]["skipped"].startswith("--max-seconds 0.1 spent")
    assert result["errors"] == ["base"] and result["skipped"] == ["dependent", "late"]


def test_unknown_sections_are_refused() -> None:
    with pytest.raises(SystemExit) as e:
        _gpu_check().main(["--device", "cpu", "--sections", "tiny_qwen3,nope"])
    assert e.value.code == 2


def test_after_an_error_that_loses_the_cuda_context_the_rest_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a section's error is followed by a probe (a small kernel); when that fails (a device
    fault poisons the context), every later section is skipped, saying why, instead of each failing."""
    gpu_check = _gpu_check()
    Section = gpu_check.Section

    def fault(b: object) -> dict[str, Any]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "cuda_usable", lambda device: "AcceleratorError: illegal memory access")
    bench = gpu_check.Bench(torch.device("cuda"), 1, 128, 0)  # never touched: the first section raises
    result = gpu_check.run_all(bench, [Section("fault", fault), Section("next", fault)], max_seconds=None)
    assert result["fault"]["cuda_usable_after"] == "AcceleratorError: illegal memory access"
    assert result["next"]["skipped"].startswith("the CUDA context failed after fault's error")
    assert result["errors"] == ["fault"] and result["skipped"] == ["next"]


@pytest.mark.parametrize(
    "family, backend",
    [
        *[(f, "paged") for f in ("qwen3_5", "gpt_oss", "gemma4", "deepseek_v3")],
        # DeepSeek's latent attention runs on the paged backend on every device (default_backend)
        *[pytest.param(f, "triton", marks=pytest.mark.slow) for f in ("qwen3_5", "gpt_oss", "gemma4")],
    ],
)
def test_the_new_families_greedy_equals_transformers(family: str, backend: str) -> None:
    """The sections that check the newer families on a GPU (the hybrid's state cache, gpt-oss's sinks,
    Gemma 4's shared KV, DeepSeek's latent cache) run here on CPU: the engine's greedy tokens equal
    transformers'."""
    _needs_interpreter(backend)
    result = _gpu_check().check_new_family(torch.device("cpu"), family, attention_backend=backend, max_tokens=6)
    assert result["attention_backend"] == backend
    assert result["tokens_equal"], result["mismatches"]
