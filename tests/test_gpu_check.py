"""benchmarks/gpu_check.py's correctness step, run here on CPU: the script itself works, and the
engine with the Triton attention backend (under TRITON_INTERPRET=1) greedy-decodes a tiny random
Qwen3 exactly like transformers, i.e. the CUDA path end to end except the device."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch


def _gpu_check() -> object:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["paged", pytest.param("triton", marks=pytest.mark.slow)])
def test_tiny_qwen3_greedy_equals_transformers(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 set before triton is imported")
    gpu_check = _gpu_check()
    result = gpu_check.check_tiny_qwen3(torch.device("cpu"), attention_backend=backend, max_tokens=8)  # type: ignore[attr-defined]
    assert result["attention_backend"] == backend
    assert result["tokens_equal"], result["mismatches"]


@pytest.mark.slow
def test_tensor_parallel_check_runs_on_cpu() -> None:
    """The script's tensor-parallel line (2 GPUs over NCCL on a CUDA machine) on CPU over gloo: the
    folder it writes loads, both engines run, and TP=2's greedy tokens equal TP=1's."""
    gpu_check = _gpu_check()
    result = gpu_check.check_tensor_parallel(torch.device("cpu"), 2, max_tokens=6)  # type: ignore[attr-defined]
    assert result["tokens_equal"], result
    assert len(result["tp1"]) == 3 and all(len(t) == 6 for t in result["tp1"])
