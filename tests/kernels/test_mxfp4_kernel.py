"""MXFP4 weights on their own 4-bit codes: quants.Int4CodeGroups with the "mxfp4" codebook, native.IQ4Packed
with that codebook, the iq4 kernels (csrc/gemm.c, gemm_avx512.c, embedding.c, decode_step.c) looking the
codes up in MXFP4's table (csrc/codebooks.h) instead of IQ4's. The bytes are written by gguf's own MXFP4
quantizer (gguf.quants.quantize) and the reference is gguf.quants.dequantize of those bytes followed by a
float64 matmul.

Tolerances, written down:
* the stored form and the rows (embedding lookups): bit for bit. Each value is a doubled e2m1 value (an
  integer in -12..12) times 2^(e - 128), a power of two: the float32 product is exact, as ggml's.
* the GEMM: the int16-activation bound of tests/kernels/test_iq4_kernel.py (each activation rounded to
  its group's step dx = absmax / 32767, |x - x_q| <= dx / 2; a group's dot is an exact int32; the scale
  x step product and the sum over groups are float32): |y - ref| <= sum_g (dx_g / 2) sum_{j in g} |w_j| +
  1e-5 (|x| @ |W|^T) + 1e-6. The mean error is also checked to sit well inside it.
* the same bits as the int8 path these codes replace (quants.mxfp4_int8_groups on the q8b kernel): both
  form the same exact int32 dot per group from the same int16 activations and then the same float32
  operations in the same order, so the outputs are torch.equal, not merely close.
* batch invariance: a row's output is bitwise the same whatever the number of rows in the call.
* a tiny Qwen3 whose every 2-D weight is MXFP4: logits of the fast path (every projection, the logits and
  the embedding on the codes; the one-call decode step) against the reference path on the same file
  within 5e-3, the tolerance test_iq4_kernel.py's IQ4_NL model uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from onecall.formats.quants import (
    Int4CodeGroups,
    cat_rows,
    mxfp4_code_groups,
    mxfp4_int8_groups,
    stored_groups,
)
from onecall.kernels.cpu import native
from tests.helpers import stored_models
from tests.helpers.make_models import random_state_dict, tiny_hf_config, write_tiny_gguf
from tests.kernels.test_iq4_kernel import MODEL_ATOL, _int16_bound

T = GGMLQuantizationType
LIB = native.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)


def _mxfp4(rows: int, cols: int, seed: int) -> tuple[Int4CodeGroups, torch.Tensor, torch.Tensor]:
    """(the file's stored form, gguf's dequantization (rows, cols) float32, the raw blocks (rows, G * 17))."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    w[:, 3] += 0.4  # a group with a larger range: another exponent
    raw = gguf_quantize(w, T.MXFP4)
    groups = stored_groups(torch.from_numpy(raw.reshape(-1).copy()), T.MXFP4, (rows, cols))  # type: ignore[arg-type]
    assert isinstance(groups, Int4CodeGroups)
    return groups, torch.from_numpy(gguf_dequantize(raw, T.MXFP4).reshape(rows, cols)), torch.from_numpy(raw)


def _gemm(
    x: torch.Tensor, g: Int4CodeGroups, bias: torch.Tensor | None = None, threads: int = 2
) -> torch.Tensor:
    assert LIB is not None
    return native.iq4_gemm(LIB, x.contiguous(), native.pack_iq4(g.q, g.scale, g.codebook), bias, threads)


def test_mxfp4_codes_are_ggufs_dequantization_bit_for_bit() -> None:
    groups, want, raw = _mxfp4(24, 512, seed=1)
    assert groups.codebook == "mxfp4" and groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    assert torch.equal(groups.dequantize(), want)
    # a checkpoint's pair (transformers' order: value 2j low nibble of byte j, 2j + 1 high) of the same
    # values: the GGUF block holds value j low, j + 16 high, after its exponent byte
    blocks = raw.view(24, 16, 17)
    codes = torch.stack((blocks[..., 1:] & 15, blocks[..., 1:] >> 4), dim=-2).reshape(24, 16, 32)
    pairs = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    from_pair = mxfp4_code_groups(pairs, blocks[..., 0].contiguous())
    assert (
        from_pair is not None and from_pair.codebook == "mxfp4" and torch.equal(from_pair.dequantize(), want)
    )


def test_codebooks_do_not_stack_together() -> None:
    """cat_rows: MXFP4 codes stack with MXFP4 codes (gate and up), never with IQ4's (another table)."""
    a, want_a, _ = _mxfp4(16, 256, seed=6)
    b, want_b, _ = _mxfp4(5, 256, seed=7)
    both = cat_rows([a, b.select_rows(torch.tensor([4, 0]))])
    assert isinstance(both, Int4CodeGroups) and both.codebook == "mxfp4"
    assert torch.equal(both.dequantize(), torch.cat((want_a, want_b[[4, 0]])))
    iq4 = Int4CodeGroups(b.q, b.scale)  # the same codes read as IQ4's
    assert cat_rows([a, iq4]) is None


@pytest.mark.parametrize("rows", [1, 3, 16, 70])  # a tile of 1, of 3, the prompt path; 70: past a chunk of 64
def test_mxfp4_gemm_within_the_activation_rounding_bound_and_the_int8_paths_bits(rows: int) -> None:
    assert LIB is not None
    groups, w, _ = _mxfp4(93, 512, seed=rows)  # 93 rows: a partial unit of 16
    bias = torch.randn(93)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(100 + rows)) * 2
    x[:, 5] = 40.0  # an outlier feature: its group's step is coarse, the bound follows it
    got = _gemm(x, groups, bias)
    ref = x.double() @ w.double().T + bias.double()
    bound = _int16_bound(x, w)
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.mean()) < 0.5 * float(bound.mean())
    int8 = mxfp4_int8_groups(*_checkpoint_pair(groups))
    assert int8 is not None
    q8b = native.q8_blocked_gemm(LIB, x, native.pack_q8_blocked(int8.q, int8.scale), bias, 2)
    assert torch.equal(got, q8b)


def _checkpoint_pair(g: Int4CodeGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales back as a checkpoint's (blocks (rows, G, 16), exponents (rows, G)) uint8."""
    rows, cols = g.shape
    codes = g.q.view(rows, cols // 32, 32)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    exponents = (torch.log2(g.scale.double()) + 128).round().to(torch.uint8)
    return blocks, exponents


def test_mxfp4_gemm_rows_are_batch_invariant_and_its_scales_half() -> None:
    groups, _, _ = _mxfp4(61, 256, seed=3)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(3))
    full = _gemm(x, groups)
    for m in (1, 2, 3, 4, 5, 9, 16, 65):
        assert torch.equal(_gemm(x[:m], groups, threads=1), full[:m])
        assert torch.equal(_gemm(x[m:], groups), full[m:])
    packed = native.pack_iq4(groups.q, groups.scale, groups.codebook)
    # 2^(e - 128) is a float16 for these weights' exponents: 4.5 bits a weight, as IQ4_NL
    assert packed.scale.dtype == torch.float16 and packed.nbytes * 8 == 4.5 * 64 * 256
    assert native.kind(packed) == "mxfp4"
    # the codebook is a parameter the kernel honours: the same codes read as IQ4's give IQ4's values
    assert LIB is not None
    as_iq4 = native.iq4_gemm(LIB, x, native.pack_iq4(groups.q, groups.scale), None, 2)
    want_iq4 = x.double() @ Int4CodeGroups(groups.q, groups.scale).dequantize().double().T
    assert not torch.equal(as_iq4, full)
    assert float((as_iq4.double() - want_iq4).abs().max()) <= float(want_iq4.abs().max()) * 1e-3


def test_mxfp4_rows_are_the_dequantized_table() -> None:
    assert LIB is not None
    groups, table, _ = _mxfp4(37, 256, seed=5)
    packed = native.pack_iq4(groups.q, groups.scale, groups.codebook)
    assert torch.equal(native.iq4_rows(LIB, packed, torch.arange(37)), table)
    ids = torch.tensor([[36, 0], [16, 15]])
    assert torch.equal(native.rows(LIB, packed, ids), table[ids])


def test_the_kernels_refuse_a_codebook_they_do_not_have() -> None:
    assert LIB is not None
    groups, _, _ = _mxfp4(16, 64, seed=8)
    p = native.pack_iq4(groups.q, groups.scale, groups.codebook)
    x, y = torch.randn(1, 64), torch.empty(1, 16)
    args = (x.data_ptr(), 1, 64, p.qs.data_ptr(), p.scale.data_ptr(), 16, None, y.data_ptr(), 1, 1)
    assert LIB.onecall_iq4_gemm(*args, 2) == -2 and LIB.onecall_iq4_gemm(*args, -1) == -2
    ids, out = torch.zeros(1, dtype=torch.int64), torch.empty(1, 64)
    rows_args = (p.qs.data_ptr(), p.scale.data_ptr(), 16, 64, 1, ids.data_ptr(), 1, out.data_ptr())
    assert LIB.onecall_iq4_rows(*rows_args, 2) == -2 and LIB.onecall_iq4_rows(*rows_args, 1) == 0


def test_an_mxfp4_gguf_runs_every_projection_on_its_codes(tmp_path: Path) -> None:
    """Every projection, the logits and the embedding on the file's MXFP4 codes, every row, and the one-call
    decode step over them; the logits the reference path's within MODEL_ATOL (a 13-token prefill, 3 decode
    steps)."""
    config = tiny_hf_config("qwen3")
    path = write_tiny_gguf(
        tmp_path / "m.gguf", random_state_dict(config, seed=3), config, weight_type=T.MXFP4
    )
    ref, fast = stored_models.load(path, fast=False), stored_models.load(path, fast=True)
    n = 4 * config["num_hidden_layers"]
    # the one-call decode step runs them too (Q4Weight.iq4 = 2)
    stored_models.assert_every_projection_stored(
        fast, n, "mxfp4", native.IQ4Packed, lambda w: w.codebook == "mxfp4"
    )
    stored_models.compare_logits(fast, ref, config["vocab_size"], MODEL_ATOL)
