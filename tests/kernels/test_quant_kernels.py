"""5-bit groups (csrc/gemm_q5.c) and 16-bit float weights (csrc/gemm_half.c) on the native kernels, against
gguf's own dequantization of the file's bytes (gguf.quants.dequantize after gguf.quants.quantize, or of
random blocks where gguf has no quantizer: Q5_K) and a float64 matmul; and models loaded from GGUFs that
store their projections so.

Tolerances, written down:
* q5 GEMM (Q5_0, Q5_1, Q5_K; int16 activations): the q4 kernel's bound (test_native_kernels.py). Each
  activation is rounded to a multiple of its group's step dx = absmax / 32767 (|x - x_q| <= dx / 2); a
  group's dot is an exact integer (up to 32 x 31 x 32767 < 2^25, so its conversion to float32 may round
  once: relative 6e-8); scaling and summation are float32. So |y - ref| <= sum_g (dx_g / 2) * sum_{j in g}
  |w_j| + 1e-5 * (|x| @ |W|^T) + 1e-6, ref = x @ W^T (+ b) in float64 on gguf's dequantized W. The mean
  error is also checked to sit well inside the bound (the bound is not trivially loose).
* half GEMM (F16, BF16): each weight widened to float32 exactly, one float32 FMA per column in order
  along K: the textbook bound of a sequential float32 dot product, |y - ref| <= K * 2^-24 * (|x| @ |W|^T),
  plus one float32 rounding of the bias add (2^-24 * (|ref| + |x| @ |W|^T)).
* batch invariance: a row's output is bitwise the same whatever the number of rows in the call.
* rows (embedding lookups) and Int5Groups / HalfWeights: bit for bit with gguf's dequantization.
* models (tiny random Llama / Qwen3, GGUF projections in Q5_0 / Q5_1 / Q5_K, or Q4_K-style mixes): the
  fast path's logits against the reference path's on the same file within 5e-3 (the families' FAST_ATOL
  for Q8_0, tests/formats/test_gguf_families.py). Measured 1e-4 to 1.1e-3 on logits of magnitude 2 to 5,
  as the q4 and q8b kernels give on the same model (Q4_0: 4e-4, Q8_0: 1.5e-4; F16 files, no activation
  rounding: 1e-6): the int16 activation steps, compounded over the layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.formats.quants import HalfWeights, Int5Groups, StoredGroups, half_weights, int5_groups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_linear import FastLinear, FastLMHead, runs_stored_only
from onecall.loading import packing
from onecall.model.moe import Experts
from tests.helpers import make_models, stored_models
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_converted_gguf, write_tiny_gguf
from tests.model.test_model_numerics import Harness, Seq

T = GGMLQuantizationType
LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
Q5_TYPES = [T.Q5_0, T.Q5_1, T.Q5_K]
MODEL_ATOL = 5e-3


# ---------------------------------------------------------------- bytes as a file stores them


def _q5_k_quantize(w: np.ndarray) -> np.ndarray:
    """A plain Q5_K quantizer (gguf has none): per 32-element sub-block, scale (max - min) / 31 and min
    -min(x, 0), both as 6-bit multiples of the super-block's d and dmin; rows (n, 176 * k / 256) uint8.
    Not llama.cpp's search for the best scales, but valid Q5_K blocks of these weights."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 31
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
    dmin = np.maximum(-lo.min(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.round((x + offset) / step), 0, 31).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)  # ggml's get_scale_min_k4 packing
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)  # bit s of qh[l]: 5th bit of element l of sub-block s
    for s in range(8):
        qh |= (q[:, s] >> 4) << s
    low = q & 15  # byte 32c + l: sub-block 2c's element l (low nibble), 2c + 1's (high)
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), scales, qh, qs], axis=1
    )
    return blocks.reshape(rows, -1)


def _quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """gguf.quants.quantize, with our plain quantizer for Q5_K (gguf has none)."""
    return _q5_k_quantize(w) if qtype == T.Q5_K else gguf_quantize(w, qtype)


def _file_bytes(rows: int, cols: int, qtype: T, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw bytes as a file holds them, gguf's dequantization of them (rows, cols) float32)."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    w[:, 3] += 0.2  # a group with a shifted range: Q5_1's / Q5_K's min matters
    raw = _quantize(w, qtype)
    return torch.from_numpy(raw.reshape(-1).copy()), torch.from_numpy(
        gguf_dequantize(raw, qtype).reshape(rows, cols)
    )


def _int5(rows: int, cols: int, qtype: T, seed: int) -> tuple[Int5Groups, torch.Tensor]:
    raw, want = _file_bytes(rows, cols, qtype, seed)
    groups = int5_groups(raw, qtype, (rows, cols))  # type: ignore[arg-type]
    assert groups is not None
    return groups, want


def _int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 (rows, N): what the int16 activation steps allow (the module docstring)."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 32767
    rounding = (step / 2) @ w.double().abs().view(w.shape[0], -1, 32).sum(-1).T
    return rounding + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6


def _q5(x: torch.Tensor, g: Int5Groups, bias: torch.Tensor | None = None, threads: int = 2) -> torch.Tensor:
    assert LIB is not None
    return native.q5_gemm(LIB, x.contiguous(), native.pack_q5(g.q, g.scale, g.offset), bias, threads)


# ---------------------------------------------------------------- the 5-bit kernel


@pytest.mark.parametrize("qtype", Q5_TYPES, ids=lambda t: t.name)
def test_int5_groups_are_ggufs_dequantization_bit_for_bit(qtype: T) -> None:
    """Q5_0 as d * q - 16 d, Q5_1 as d * q + m, Q5_K as (d sc) q - dmin m: each product and sum the
    float32 operation ggml's dequantize_row_* does (a float16 d times q < 32 is exact)."""
    groups, want = _int5(24, 512, qtype, seed=1)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 31 and groups.scale.shape == (24, 16)
    assert torch.equal(groups.dequantize(), want)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 33, 70])  # tiles of 4, 2, 1; 70: past a chunk of 64
@pytest.mark.parametrize("qtype", Q5_TYPES, ids=lambda t: t.name)
def test_q5_gemm_within_the_activation_rounding_bound(qtype: T, rows: int) -> None:
    groups, w = _int5(93, 512, qtype, seed=rows)  # 93 rows: a partial unit of 16
    bias = torch.randn(93)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(100 + rows)) * 2
    x[:, 5] = 40.0  # an outlier feature: its group's step is coarse, the bound follows it
    got = _q5(x, groups, bias).double()
    ref = x.double() @ w.double().T + bias.double()
    bound = _int16_bound(x, w)
    assert bool(((got - ref).abs() <= bound).all()), float(((got - ref).abs() / bound).max())
    assert float((got - ref).abs().mean()) < 0.5 * float(bound.mean())


def test_q5_gemm_rows_are_batch_invariant_and_half_scales_give_the_float32_bits() -> None:
    assert LIB is not None
    groups, _ = _int5(61, 256, T.Q5_0, seed=3)  # Q5_0's scales d and -16 d are exact in float16
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(3))
    full = _q5(x, groups)
    for m in (1, 2, 3, 4, 5, 9, 16, 65):
        assert torch.equal(_q5(x[:m], groups, threads=1), full[:m])
        assert torch.equal(_q5(x[m:], groups), full[m:])
    half = native.pack_q5(groups.q, groups.scale.half(), groups.offset.half())
    assert half.scale.dtype == torch.float16 and half.nbytes * 8 == 6 * 64 * 256  # 6 bits a weight
    assert torch.equal(native.q5_gemm(LIB, x, half, None, 2), full)


def test_q5_gemm_a_nan_poisons_its_row_only() -> None:
    groups, _ = _int5(20, 64, T.Q5_1, seed=4)
    for col in (0, 17, 31, 40):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(col))
        x[1, col] = float("nan")
        y = _q5(x, groups)
        assert bool(y[1].isnan().all()) and not bool(y[0].isnan().any() or y[2].isnan().any())


@pytest.mark.parametrize("qtype", Q5_TYPES, ids=lambda t: t.name)
def test_q5_rows_are_the_dequantized_table(qtype: T) -> None:
    assert LIB is not None
    groups, table = _int5(37, 256, qtype, seed=5)
    packed = native.pack_q5(groups.q, groups.scale, groups.offset)
    assert torch.equal(native.q5_rows(LIB, packed, torch.arange(37)), table)
    ids = torch.tensor([[36, 0], [16, 15]])
    assert torch.equal(native.rows(LIB, packed, ids), table[ids])
    with pytest.raises(IndexError, match="37 rows"):
        native.q5_rows(LIB, packed, torch.tensor([37]))


# ---------------------------------------------------------------- the 16-bit float kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 13, 70])  # tiles 4 x 1 unit, 2 x 2, 1 x 4
@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_half_gemm_within_a_float32_dot_products_bound(qtype: T, rows: int) -> None:
    assert LIB is not None
    n, k = 85, 200  # 6 units of 16 rows, the last partial; K needs no multiple of 32
    w32 = torch.randn(n, k, generator=torch.Generator().manual_seed(rows)).numpy() * 0.1
    raw = torch.from_numpy(gguf_quantize(w32, qtype).reshape(-1).copy()).view(torch.uint8)
    halves = half_weights(raw, qtype, (n, k))  # type: ignore[arg-type]
    assert isinstance(halves, HalfWeights)
    w = torch.from_numpy(gguf_dequantize(gguf_quantize(w32, qtype), qtype).reshape(n, k))
    assert torch.equal(halves.dequantize(), w)
    packed = native.pack_half(halves.values)
    bias = torch.randn(n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(50 + rows))
    got = native.half_gemm(LIB, x, packed, bias, 2).double()
    ref = x.double() @ w.double().T + bias.double()
    spread = x.double().abs() @ w.double().abs().T
    bound = k * 2**-24 * spread + 2**-24 * (ref.abs() + spread)
    assert bool(((got - ref).abs() <= bound).all())
    for m in range(rows):  # each row alone: the same bits
        assert torch.equal(native.half_gemm(LIB, x[m : m + 1], packed, bias, 1).double(), got[m : m + 1])
    assert torch.equal(native.rows(LIB, packed, torch.tensor([0, n - 1, 17])), w[[0, n - 1, 17]])


# ---------------------------------------------------------------- FastLinear and FastLMHead


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_fast_linear_runs_a_q4_k_m_style_mix_every_row(rows: int) -> None:
    """A fused q/k/v whose parts were stored as Q4_K_M files store them where widths are not a multiple of
    256: q in Q4_0, k in Q5_0, v in Q8_0 (llama-quantize's fallbacks for Q4_K, Q6_K), one half part: every
    row on each part's own kernel, no float32 copy; each part within its kernel's bound."""
    from onecall.formats.quants import int4_groups, int8_groups

    cols = 256
    parts: list[tuple[int, int, StoredGroups]] = []
    dense = []
    start = 0
    for qtype, n in ((T.Q4_0, 32), (T.Q5_0, 16), (T.Q5_K, 16), (T.Q8_0, 16), (T.F16, 16)):
        raw, w = _file_bytes(n, cols, qtype, seed=n + int(qtype))
        g = (int4_groups(raw, qtype, (n, cols)) or int5_groups(raw, qtype, (n, cols))  # type: ignore[arg-type]
             or int8_groups(raw, qtype, (n, cols)) or half_weights(raw, qtype, (n, cols)))  # type: ignore[arg-type]  # fmt: skip
        assert g is not None and torch.equal(g.dequantize(), w)
        parts.append((start, start + n, g))
        dense.append(w)
        start += n
    weight = torch.cat(dense)
    assert runs_stored_only(parts)
    bias = torch.randn(start)
    fast = FastLinear(None, bias, parts)
    assert fast.every_row and fast.packed is None  # no oneDNN float32 copy
    assert fast.decode_kernel == "native f16+int4+int5+int8"
    assert [type(p) for _, _, p in fast.parts] == [
        native.Q4Packed,
        native.Q5Packed,
        native.Q8Blocked,
        native.HalfPacked,
    ]
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got = fast(x).double()
    ref = x.double() @ weight.double().T + bias.double()
    assert bool(((got - ref).abs() <= _int16_bound(x, weight) + 1e-6).all())
    for m in range(min(rows, 3)):  # batch invariance across the parts
        with torch.no_grad():
            assert torch.equal(fast(x[m : m + 1]).double(), got[m : m + 1])


@pytest.mark.parametrize("qtype", [T.Q5_K, T.BF16], ids=lambda t: t.name)
def test_lm_head_runs_5bit_and_16bit_output_weights_as_stored(qtype: T) -> None:
    raw, w = _file_bytes(40, 256, qtype, seed=8)
    stored = int5_groups(raw, qtype, (40, 256)) or half_weights(raw, qtype, (40, 256))  # type: ignore[arg-type]
    assert stored is not None
    head = FastLMHead(torch.empty(40, 256, device="meta"), stored)  # never a float32 matrix
    assert head.from_stored and head.kernel == ("native q5" if qtype == T.Q5_K else "native bf16")
    x = torch.randn(3, 256)
    got, ref = head(x).double(), x.double() @ w.double().T
    bound = _int16_bound(x, w) if qtype == T.Q5_K else 256 * 2**-24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((got - ref).abs() <= bound).all())


# ---------------------------------------------------------------- models from GGUF files








@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", T.Q5_0), ("qwen3", T.Q5_1), ("qwen3", T.Q5_K)],
    ids=["llama-Q5_0", "qwen3-Q5_1", "qwen3-Q5_K"],
)
def test_a_5bit_gguf_runs_every_projection_on_the_q5_kernel(
    arch: str, qtype: T, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection (Llama: q/k rows un-permuted with their groups) on the q5 kernel, for every row,
    from the file's own groups: no projection weight in float32 (none expanded, none a parameter, no
    oneDNN copy); the logits the reference path's on the same file within MODEL_ATOL; DecoderLM.kernels
    says so."""
    overrides = (
        {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 64}
        if qtype == T.Q5_K
        else {}
    )
    config = tiny_hf_config(arch, **overrides)
    monkeypatch.setattr(make_models, "quantize", _quantize)  # Q5_K too
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=3), config, weight_type=qtype)
    ref = stored_models.load(path, fast=False)
    with monkeypatch.context() as m:
        m.setattr(packing.StreamingPacker, "_dense", stored_models.never)  # where a meta part would be expanded
        fast = stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    stored_models.assert_every_projection_stored(fast, n, "int5", native.Q5Packed)
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)


def test_a_q4_k_m_style_mix_names_each_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-quantize's Q4_K_M on a width that is not a multiple of 256 keeps Q4-style q/k/o/gate/up in
    Q5_0 and v / down in Q8_0 (its fallbacks for Q4_K and Q6_K): here q/k/o/gate/up Q4_0, v Q5_0, down
    Q8_0. Every projection every row on the file's own groups, the kernels line naming all three; the
    fused qkv in two parts runs in the one-call decode step as a chain, to the per-op path's bits."""
    config = tiny_hf_config("qwen3")
    path = write_converted_gguf(
        tmp_path / "mix.gguf", random_state_dict(config, seed=4), config, weight_type=T.Q4_0,
        type_overrides={"attn_v": T.Q5_0, "ffn_down": T.Q8_0},
    )  # fmt: skip
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    assert f"native int4+int5+int8 ({n} of {n} projections, every row)" in fast.kernels, fast.kernels
    qkv = fast.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert isinstance(qkv, FastLinear) and len(qkv.parts) == 2  # q/k one 4-bit part, v a 5-bit one
    assert fast.native_step is not None  # the parts run as a chain in the one-call step
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)
    # an all-decode step through the chain gives the per-op path's bits (hidden states and the KV written)
    step, tokens = fast.native_step, list(range(5, 18))
    calls = []
    monkeypatch.setattr(type(step), "__call__", _counted(type(step).__call__, calls))
    caches = []
    for native_step in (step, None):
        fast.native_step = native_step
        harness, seq = Harness(fast), Seq(list(tokens))
        harness.kv_cache.k.zero_(), harness.kv_cache.v.zero_()  # unwritten slots compare equal
        harness.step([(seq, 13)])
        seq.tokens.append(7)
        caches.append((harness.step([(seq, 1)], num_decode=1)[0], harness.kv_cache))
    (got, got_kv), (want, want_kv) = caches
    assert len(calls) == 1  # the decode step of the first run, on the chain
    assert torch.equal(got, want) and torch.equal(got_kv.k, want_kv.k) and torch.equal(got_kv.v, want_kv.v)


def _counted(fn: Any, calls: list[int]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------- types that are exactly int8 groups


_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_nl_quantize(w: np.ndarray) -> np.ndarray:
    """A plain IQ4_NL quantizer (gguf has none): d = -absmax / 127 per 32 (the codebook's widest entry
    is -127), each value its nearest codebook entry; rows (n, 18 * k / 32) uint8."""
    rows = w.shape[0]
    x = w.astype(np.float32).reshape(-1, 32)
    d = (-np.abs(x).max(-1, keepdims=True) / 127).astype(np.float16)
    q = np.abs(x[..., None] - d.astype(np.float32)[..., None] * _IQ4).argmin(-1).astype(np.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=1).reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.Q3_K], ids=lambda t: t.name)
def test_q8b_gemm_runs_the_int8_conversions_within_the_activation_rounding_bound(qtype: T) -> None:
    """The int8 forms of IQ4_NL, IQ4_XS, MXFP4 (groups of 32) and Q3_K (groups of 16) on the q8b kernel,
    against gguf's dequantization of the same bytes: the int16 activation bound (module docstring)."""
    from onecall.formats.quants import int8_groups
    from tests.formats.test_stored_groups import random_blocks

    assert LIB is not None
    n, k = 40, 512
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, n * k // block_size, seed=7)
    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k))
    groups = int8_groups(torch.from_numpy(raw.reshape(-1).copy()), qtype, (n, k))  # type: ignore[arg-type]
    assert groups is not None and torch.equal(groups.dequantize(), w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
    got = native.q8_blocked_gemm(
        LIB, x, native.pack_q8_blocked(groups.q, groups.scale, groups.group_size), None, 2
    )
    ref = x.double() @ w.double().T
    assert bool(((got.double() - ref).abs() <= _int16_bound(x, w)).all())


def test_an_iq4_nl_gguf_runs_its_projections_on_the_iq4_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_hf_config("qwen3")
    monkeypatch.setattr(
        make_models, "quantize", lambda a, q: _iq4_nl_quantize(a) if q == T.IQ4_NL else gguf_quantize(a, q)
    )
    path = write_tiny_gguf(
        tmp_path / "iq4.gguf", random_state_dict(config, seed=5), config, weight_type=T.IQ4_NL
    )
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    assert f"native iq4 ({n} of {n} projections, every row)" in fast.kernels, fast.kernels  # their own codes
    assert fast.native_step is not None
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)


def test_mxfp4_experts_run_on_their_own_codes(tmp_path: Path) -> None:
    """gpt-oss keeps its experts in MXFP4: stacked (E, rows, cols) expert tensors, split per expert by the
    GGUF reader, each one's 4-bit codes packed for the iq4 kernel with the mxfp4 codebook; every MoE layer
    runs them (their float32 parameters freed), the logits the reference path's within MODEL_ATOL."""
    from tests.formats.test_gguf_families import random_hf

    hf = random_hf("qwen3_moe", seed=3)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    mxfp4 = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), T.MXFP4)
    path = write_converted_gguf(
        tmp_path / "moe.gguf", state, hf.config.to_dict(), weight_type=T.Q8_0, type_overrides=mxfp4
    )
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    layers = hf.config.num_hidden_layers
    assert f"experts native mxfp4 ({layers} of {layers} MoE layers)" in fast.kernels, fast.kernels
    experts = [m for m in fast.modules() if isinstance(m, Experts)]
    assert len(experts) == layers and all(m.gate_up_proj.numel() == m.down_proj.numel() == 0 for m in experts)
    stored_models.compare_logits(fast, ref, hf.config.vocab_size, MODEL_ATOL)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_a_16bit_gguf_runs_without_a_float32_copy(
    qtype: T, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F16 / BF16 projections, embedding and logits on the half GEMM from the file's own 16-bit values:
    nothing expanded to float32; float32 arithmetic throughout (no activation rounding), so the logits are
    the reference path's within 1e-4 (tests/model/test_model_numerics' ATOL; measured 1e-6)."""
    config = tiny_hf_config("llama")
    path = write_tiny_gguf(tmp_path / "h.gguf", random_state_dict(config, seed=6), config, weight_type=qtype)
    ref = stored_models.load(path, fast=False)
    with monkeypatch.context() as m:
        m.setattr(packing.StreamingPacker, "_dense", stored_models.never)
        fast = stored_models.load(path, fast=True)
    n, kind = 4 * config["num_hidden_layers"], qtype.name.lower()
    assert f"native {kind} ({n} of {n} projections, every row), native {kind} logits" in fast.kernels
    assert not any(name.endswith("proj.weight") for name, _ in fast.named_parameters())
    assert fast.native_step is not None
    stored_models.compare_logits(fast, ref, config["vocab_size"], 1e-4)


def test_a_5bit_phi3_gguf_runs_on_its_split_and_permuted_groups(tmp_path: Path) -> None:
    """Phi-3's fused attn_qkv / ffn_up are split into parts (formats/fused.py), and its partial-rotary q / k
    rows permuted, on the stored groups too (stored_rows: every stored form's select_rows): its Q5_0
    projections run on the 5-bit kernel, and run right: the logits the reference path's."""
    from tests.formats.test_gguf_families import random_hf

    hf = random_hf("phi3", seed=4)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    path = write_converted_gguf(tmp_path / "phi3.gguf", state, hf.config.to_dict(), weight_type=T.Q5_0)
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    assert fast.kernels.startswith("native int5 (8 of 8 projections, every row)"), fast.kernels
    stored_models.compare_logits(fast, ref, hf.config.vocab_size, MODEL_ATOL)
