"""IQ4_NL / IQ4_XS weights on their own 4-bit codes (quants.Int4CodeGroups, native.IQ4Packed, the iq4
kernel in csrc/gemm.c), against gguf's own dequantization of the file's bytes (gguf.quants.dequantize of
blocks written by the plain quantizer below: gguf has none for these types) and a float64 matmul; and a
tiny model from an IQ4_NL GGUF.

Tolerances, written down:
* the GEMM: the q4 / q5 kernels' bound (tests/kernels/test_quant_kernels.py). Each activation is rounded
  to a multiple of its group's step dx = absmax / 32767 (|x - x_q| <= dx / 2, act_quant.h, as every
  int16-activation kernel rounds it); a group's dot of int8 codebook values by int16 steps is an exact
  integer (|dot| <= 32 x 127 x 32767 < 2^27, so its conversion to float32 may round once: relative 6e-8);
  the scale x step product and the sum over K / 32 groups are float32 (relative 2^-24 each, at most
  K / 32 + 2 of them: 1.1e-6 for K 512). So |y - ref| <= sum_g (dx_g / 2) * sum_{j in g} |w_j| + 1e-5 *
  (|x| @ |W|^T) + 1e-6, ref = x @ W^T (+ b) in float64 on gguf's dequantized W. The mean error is also
  checked to sit well inside the bound (the bound is not trivially loose).
* batch invariance: a row's output is bitwise the same whatever the number of rows in the call, and
  float16 scales (where exact) give the float32 scales' bits.
* Int4CodeGroups and rows (embedding lookups): bit for bit with gguf's dequantization.
* the model (tiny random Qwen3, every 2-D weight IQ4_NL): the fast path's logits against the reference
  path's on the same file within 5e-3, the tolerance test_quant_kernels.py's GGUF models use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.formats.quants import Int4CodeGroups, Int8Groups, cat_rows, stored_groups
from onecall.kernels.cpu import native
from onecall.loading import packing
from tests.helpers import make_models, stored_models
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf

T = GGMLQuantizationType
LIB = native.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
IQ4_TYPES = [T.IQ4_NL, T.IQ4_XS]
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
MODEL_ATOL = 5e-3


# ---------------------------------------------------------------- bytes as a file stores them


def _codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest codebook entry's index for each value of x (..., 32) at its group's step (...)."""
    return np.abs(x[..., None] - KVALUES * step[..., None, None]).argmin(-1).astype(np.uint8)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(..., 32) codes -> (..., 16) bytes: element j in the low nibble, j + 16 in the high one."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _iq4_quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """A plain IQ4_NL / IQ4_XS quantizer (gguf has none): per group of 32 the step amax / 127, the
    nearest codebook value; IQ4_XS's steps as 6-bit multiples (s - 32 in -32..31) of the super-block's d.
    Not llama.cpp's search, but valid blocks of these weights; rows (n, type_size * k / block) uint8."""
    if qtype not in IQ4_TYPES:
        return gguf_quantize(w, qtype)
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(-1, 32)
    step = np.maximum(np.abs(x).max(-1) / 127, 1e-8)
    if qtype == T.IQ4_NL:
        d = step.astype(np.float16)
        qs = _pack_nibbles(_codes(x, d.astype(np.float32)))
        return np.concatenate([d[:, None].view(np.uint8), qs], axis=1).reshape(rows, -1)
    x, step = x.reshape(-1, 8, 32), step.reshape(-1, 8)
    d = (step.max(-1) / 31).astype(np.float16)
    ls = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 31).astype(np.int32) + 32  # 6 bits
    sub = d.astype(np.float32)[:, None] * (ls - 32)
    qs = _pack_nibbles(_codes(x, sub)).reshape(-1, 128)
    scales_h = np.zeros(len(ls), dtype=np.uint16)
    for i in range(8):
        scales_h |= ((ls[:, i] >> 4) & 3).astype(np.uint16) << (2 * i)
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)  # sub-block i: byte i // 2
    blocks = [d[:, None].view(np.uint8), scales_h[:, None].view(np.uint8), scales_l, qs]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


def _iq4(rows: int, cols: int, qtype: T, seed: int) -> tuple[Int4CodeGroups, torch.Tensor]:
    """(the file's stored form, gguf's dequantization of its bytes (rows, cols) float32)."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    w[:, 3] += 0.2  # a group with a larger range
    raw = _iq4_quantize(w, qtype)
    groups = stored_groups(torch.from_numpy(raw.reshape(-1).copy()), qtype, (rows, cols))  # type: ignore[arg-type]
    assert isinstance(groups, Int4CodeGroups)
    return groups, torch.from_numpy(gguf_dequantize(raw, qtype).reshape(rows, cols))


def _int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 (rows, N): what the int16 activation steps allow (the module docstring)."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 32767
    rounding = (step / 2) @ w.double().abs().view(w.shape[0], -1, 32).sum(-1).T
    return rounding + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6


def _gemm(x: torch.Tensor, g: Int4CodeGroups, bias: torch.Tensor | None = None, threads: int = 2) -> torch.Tensor:
    assert LIB is not None
    return native.iq4_gemm(LIB, x.contiguous(), native.pack_iq4(g.q, g.scale), bias, threads)


# ---------------------------------------------------------------- the stored form and the kernel


@pytest.mark.parametrize("qtype", IQ4_TYPES, ids=lambda t: t.name)
def test_int4_code_groups_are_ggufs_dequantization_bit_for_bit(qtype: T) -> None:
    """codebook[code] * d (IQ4_NL) or * d (s - 32) (IQ4_XS, exact in float32): one float32 product, as
    ggml's dequantize_row_iq4_*."""
    groups, want = _iq4(24, 512, qtype, seed=1)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15 and groups.scale.shape == (24, 16)
    assert torch.equal(groups.dequantize(), want)


def test_iq4_rows_stack_by_one_form() -> None:
    """cat_rows (fused q/k/v, gate/up): IQ4 parts stack into one Int4CodeGroups (IQ4_NL beside IQ4_XS
    too: one form), exactly the stacked dequantizations; beside int8 groups they do not."""
    a, want_a = _iq4(16, 256, T.IQ4_NL, seed=6)
    b, want_b = _iq4(5, 256, T.IQ4_XS, seed=7)
    both = cat_rows([a, b.select_rows(torch.tensor([4, 0]))])
    assert isinstance(both, Int4CodeGroups)
    assert torch.equal(both.dequantize(), torch.cat((want_a, want_b[[4, 0]])))
    q8 = Int8Groups(torch.zeros(2, 256, dtype=torch.int8), torch.ones(2, 8))
    assert cat_rows([a, q8]) is None


@pytest.mark.parametrize("rows", [1, 3, 16, 70])  # a tile of 1, of 3, 5 x 3 + 1; 70: past a chunk of 64
@pytest.mark.parametrize("qtype", IQ4_TYPES, ids=lambda t: t.name)
def test_iq4_gemm_within_the_activation_rounding_bound(qtype: T, rows: int) -> None:
    groups, w = _iq4(93, 512, qtype, seed=rows)  # 93 rows: a partial unit of 16
    bias = torch.randn(93)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(100 + rows)) * 2
    x[:, 5] = 40.0  # an outlier feature: its group's step is coarse, the bound follows it
    got = _gemm(x, groups, bias).double()
    ref = x.double() @ w.double().T + bias.double()
    bound = _int16_bound(x, w)
    err = (got - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.mean()) < 0.5 * float(bound.mean())


@pytest.mark.parametrize("qtype", IQ4_TYPES, ids=lambda t: t.name)
def test_iq4_gemm_rows_are_batch_invariant_and_half_scales_give_the_float32_bits(qtype: T) -> None:
    assert LIB is not None
    groups, _ = _iq4(61, 256, qtype, seed=3)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(3))
    full = _gemm(x, groups)
    for m in (1, 2, 3, 4, 5, 9, 16, 65):
        assert torch.equal(_gemm(x[:m], groups, threads=1), full[:m])
        assert torch.equal(_gemm(x[m:], groups), full[m:])
    packed = native.pack_iq4(groups.q, groups.scale)
    # IQ4_NL's d is a float16 (4.5 bits a weight); IQ4_XS's d (s - 32) need not be one (float32: 5)
    assert packed.scale.dtype == torch.float16 or qtype == T.IQ4_XS
    half = native.pack_iq4(groups.q, groups.scale.half().float())
    assert half.scale.dtype == torch.float16 and half.nbytes * 8 == 4.5 * 64 * 256
    halved = Int4CodeGroups(groups.q, groups.scale.half().float())
    assert torch.equal(native.iq4_gemm(LIB, x, half, None, 2), _gemm(x, halved))


def test_iq4_gemm_a_nan_poisons_its_row_only() -> None:
    groups, _ = _iq4(20, 64, T.IQ4_NL, seed=4)
    for col in (0, 17, 31, 40):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(col))
        x[1, col] = float("nan")
        y = _gemm(x, groups)
        assert bool(y[1].isnan().all()) and not bool(y[0].isnan().any() or y[2].isnan().any())


@pytest.mark.parametrize("qtype", IQ4_TYPES, ids=lambda t: t.name)
def test_iq4_rows_are_the_dequantized_table(qtype: T) -> None:
    assert LIB is not None
    groups, table = _iq4(37, 256, qtype, seed=5)
    packed = native.pack_iq4(groups.q, groups.scale)
    assert native.kind(packed) == "iq4"
    assert torch.equal(native.iq4_rows(LIB, packed, torch.arange(37)), table)
    ids = torch.tensor([[36, 0], [16, 15]])
    assert torch.equal(native.rows(LIB, packed, ids), table[ids])
    with pytest.raises(IndexError, match="37 rows"):
        native.iq4_rows(LIB, packed, torch.tensor([37]))


# ---------------------------------------------------------------- a model from an IQ4_NL GGUF






def test_an_iq4_nl_gguf_runs_every_projection_on_the_iq4_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection, the logits and the embedding on the file's own IQ4 codes, every row; the logits
    the reference path's on the same file within MODEL_ATOL (a 13-token prefill, 3 decode steps)."""
    config = tiny_hf_config("qwen3")
    monkeypatch.setattr(make_models, "quantize", _iq4_quantize)
    path = write_tiny_gguf(tmp_path / "m.gguf", random_state_dict(config, seed=3), config, weight_type=T.IQ4_NL)
    ref = stored_models.load(path, fast=False)
    with monkeypatch.context() as m:
        m.setattr(packing.StreamingPacker, "_dense", stored_models.never)
        fast = stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    stored_models.assert_every_projection_stored(fast, n, "iq4", native.IQ4Packed)
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)
