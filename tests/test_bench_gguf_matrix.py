"""benchmarks/make_gguf_mixes.py and benchmarks/bench_gguf_matrix.py without running a benchmark.

- the F16 file the mix maker writes has llama.cpp's converter layout (2-D weights F16, norms F32)
  and the embedded model's tokenizer and chat template; its reported mix (gguf's GGUFReader)
  agrees with onecall's own GGUF reader, tensor by tensor;
- llama.cpp's quantizer (skipped without llama_cpp) turns it into the mixes the report claims: Q8_0
  is Q8_0 throughout; Q4_K_M puts K-quants on rows that are a multiple of 256 wide and falls back to
  a 32-block type on the others (a model with intermediate 320: ffn_down's rows), norms stay F32;
  an unknown preset is refused by name;
- the matrix's ratios (onecall / llama.cpp: best over best, and round by round) and markdown come
  out of canned results, with a failed engine named instead of a ratio.
A tiny model (hidden 256, 2 layers, the embedded tokenizer's 49,152-token vocabulary): a few seconds;
the quantizer's cases are marked slow (and need llama-cpp-python, installed by `make bench`).
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def _benchmark(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def mixes() -> ModuleType:
    return _benchmark("make_gguf_mixes")


@pytest.fixture(scope="module")
def f16_file(mixes: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = mixes.embedded_tokenizer_metadata()
    config = mixes.hf_config(
        "tiny", len(tokenizer["tokenizer.ggml.tokens"]), hidden_size=256, intermediate_size=320,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    return mixes.write_f16(tmp_path_factory.mktemp("mixes") / "tiny-F16.gguf", config, tokenizer)


def _types_by_onecall(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type name, torch shape), read by onecall's reader (independent of gguf's)."""
    from onecall.formats.ggml_types import GGML_TYPE_SIZES
    from onecall.formats.gguf import GGUFFile

    return {t.name: (GGML_TYPE_SIZES[t.ggml_type][0], t.shape) for t in GGUFFile(path).tensors}


def _mix_from(types: dict[str, tuple[str, tuple[int, ...]]], mixes: ModuleType) -> dict[str, dict[str, int]]:
    mix: dict[str, Counter[str]] = {}
    for name, (type_name, _) in types.items():
        mix.setdefault(mixes.tensor_role(name), Counter())[type_name] += 1
    return {role: dict(counts) for role, counts in mix.items()}


@pytest.mark.slow
def test_f16_file_layout_tokenizer_and_reported_mix(mixes: ModuleType, f16_file: Path) -> None:
    from onecall.formats.gguf import GGUFFile

    types = _types_by_onecall(f16_file)
    assert mixes.tensor_mix(f16_file) == _mix_from(types, mixes)
    for name, (type_name, shape) in types.items():
        assert type_name == ("F16" if len(shape) == 2 else "F32"), name
    assert "output.weight" not in types  # tied, as the converter writes it
    meta = GGUFFile(f16_file).metadata
    assert meta["general.architecture"] == "llama"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    assert len(meta["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.slow  # two quantizations and two GGUFReader parses of a 49,152-token vocabulary
@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
def test_llama_cpp_quantizer_makes_the_reported_mix(
    mixes: ModuleType, f16_file: Path, preset: str, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp")
    target = tmp_path / f"tiny-{preset}.gguf"
    assert mixes.quantize(f16_file, target, preset, threads=1) is None
    types = _types_by_onecall(target)
    record = mixes.describe(target, "tiny", preset)
    assert record["mix"] == _mix_from(types, mixes) and record["size_bytes"] == target.stat().st_size
    for name, (type_name, shape) in types.items():
        if len(shape) == 1:
            assert type_name == "F32", name
        elif preset == "Q8_0":
            assert type_name == "Q8_0", name
        elif (
            shape[1] % 256 == 0
        ):  # a row of 256 multiples: a K-quant (Q4_K, or Q6_K where it keeps more bits)
            assert type_name in K_QUANTS, (name, type_name)
        else:  # ffn_down's 320-wide rows: llama.cpp's fallback to a 32-block type
            assert type_name not in K_QUANTS and name.endswith("ffn_down.weight"), (name, type_name)
    assert target.with_suffix(".quantize.log").exists()


def test_unknown_preset_is_refused_by_name(mixes: ModuleType) -> None:
    pytest.importorskip("llama_cpp")
    with pytest.raises(SystemExit, match="Q4_Z"):
        mixes.llama_ftype("Q4_Z")


def _result(decode: float, prefill: float, rss: float, second_decode: float) -> dict[str, Any]:
    """An engine's result as _peers.Measurement reports it (two rounds of each timed metric)."""
    return {
        "cold_start": {"wall_s": 2.0},
        "prefill_tokens_per_s": {"best": prefill, "runs": [prefill / 2, prefill]},
        "decode_tokens_per_s": {"best": decode, "runs": [decode, second_decode]},
        "long_decode": {"tokens_per_s": decode / 2, "runs": [decode / 2]},
        "aggregate": {"tokens_per_s": 4 * decode, "num_requests": 16, "runs": [4 * decode]},
        "memory": {"loaded_rss_mb": rss, "peak_rss_mb": rss},
        "kv_pool": {"bytes": 2**20},
    }


def test_ratios_and_markdown_from_canned_results() -> None:
    matrix = _benchmark("bench_gguf_matrix")
    # round 2 of decode: onecall 5, llama.cpp 4 (a busy minute for both): best/best is 0.5, the rounds 0.5 and 1.25
    results = {"onecall": _result(10.0, 300.0, 400.0, 5.0), "llamacpp": _result(20.0, 100.0, 200.0, 4.0)}
    results["onecall"]["info"] = {"kernels": "native q4 (1 of 1 projections)"}
    ratios = matrix.ratios(results)
    assert ratios["onecall"]["decode"] == 0.5 and ratios["onecall"]["prefill"] == 3.0
    rounds = matrix.round_ratios(results)
    assert rounds["onecall"]["decode"] == [0.5, 1.25] and rounds["onecall"]["prefill"] == [3.0, 3.0]
    record = {
        "file": "/tmp/x/tiny-Q4_K_M.gguf", "shape": "tiny", "preset": "Q4_K_M", "size_bytes": 10**8,
        "started": "2026-01-01T00:00:00", "wall_s": 1.0, "loadavg_before_after": [1.0, 1.0],
        "workload": {"prefill_len": 512, "decode_tokens": 64, "long_context": 1024, "concurrent": 16,
                     "sequential_budget_s": 30.0},
        "weight_types": {"Q4_K": 3}, "results": results, "ratios": ratios, "round_ratios": rounds,
        "kernels": {"onecall": results["onecall"]["info"]["kernels"]},
    }  # fmt: skip
    table = matrix.markdown_file(record)
    assert (
        "| decode tok/s, batch 1, 64 tokens (higher is better) | 10.00 | 20.00 | 0.50x (0.50, 1.25) |"
        in table
    )
    assert "`native q4 (1 of 1 projections)`" in table
    assert "onecall: prefill 150/300, decode 10.00/5.00, long 5.00, concurrent 40.00" in table
    assert (
        "| tiny Q4_K_M | 100 | onecall | 0.50x (0.50, 1.25) | 3.00x (3.00, 3.00) |"
        in matrix.markdown_summary([record])
    )
    failed = {**record, "results": {"onecall": {"error": "exit code 1"}, "llamacpp": results["llamacpp"]}}
    failed["ratios"], failed["round_ratios"] = (
        matrix.ratios(failed["results"]),
        matrix.round_ratios(failed["results"]),
    )
    assert "onecall FAILED: exit code 1" in matrix.markdown_file(failed)
    assert "no ratio (onecall: exit code 1)" in matrix.markdown_summary([failed])
