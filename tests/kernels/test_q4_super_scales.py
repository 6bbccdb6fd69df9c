"""The q4 kernel's super-block scales (native.pack_q4_super, csrc/act_quant.h's Q4_SUPER): Q4_K's scales and
offsets kept as d x 6-bit sub-scale and -dmin x 6-bit min instead of float32 per group.

What is checked, and with what tolerance:
* bit for bit: Q4_K blocks of random bytes (finite d and dmin; any 6-bit scales and mins, so a
  super-block's largest scale is often not 63 and the factor search's slow path runs too), read by
  formats/quants.py into Int4Groups, packed both ways (float32 scales: pack_q4; factors: pack_q4_super),
  give torch.equal outputs through onecall_q4_gemm on the AVX2 tiles and, where the CPU has them, the
  AVX-512 tiles (decode tiles and the buffered prompt path), for M in (1, 2, 3, 5, 9, 70), with and
  without a bias, N 40 (a partial unit of 16 rows) and 48. The factors' products are the float32 scales
  exactly, so any difference is a bug.
* against float64 (so two equally wrong layouts cannot pass): the gguf package's dequantization of the
  same bytes, x @ W^T in float64, within the q4 kernel's int16-activation bound of
  tests/kernels/test_native_kernels.py: |y - ref| <= sum_g (dx_g / 2) sum_{j in g} |w_j| + 1e-5 (|x| @
  |W|^T) + 1e-6, dx_g = absmax / 32767 (activation rounding, then float32 accumulation).
* the form is chosen only where it is exact and smaller: float32 scales that are not such products, and K
  not a multiple of 256, get None (pack_q4_groups then keeps float32), and the kernel refuses factors
  with K % 256 != 0 (rc -2) rather than read past them.
* the one-call decode step (loading/native_step.py) hands a factored part to the kernel as f16 = 2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from onecall.formats.quants import T, int4_groups
from onecall.kernels.cpu import native, native_build
from onecall.kernels.cpu.fast_linear import pack_q4_groups
from onecall.loading.native_step import _part

LIB = native_build.load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason=f"native kernels unavailable: {native_build.unavailable_reason()}"
)
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= native_build.cpu_flags()
Q4_K_BYTES = 144  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles


def _q4_k_raw(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(n * k / 256 * 144,) uint8: Q4_K blocks of random bytes, d and dmin finite positive halves."""
    blocks = torch.randint(0, 256, (n * k // 256, Q4_K_BYTES), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n * k // 256, 2, generator=gen) * 0.01 + 1e-4).half()
    blocks[:, :4] = d.view(torch.uint8)
    return blocks.reshape(-1)


def _reference(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    w = quants.dequantize(raw.numpy(), GGMLQuantizationType.Q4_K)
    return torch.from_numpy(np.asarray(w, dtype=np.float64)).reshape(n, k)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd, groups = x.double(), x.shape[1] // 32
    dx = xd.abs().view(x.shape[0], groups, 32).amax(-1) / 32767  # (M, G)
    wsum = w.abs().view(w.shape[0], groups, 32).sum(-1)  # (N, G)
    return (dx / 2) @ wsum.T + 1e-5 * (xd.abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("n", [40, 48])
def test_factors_match_float32_scales_bit_for_bit(n: int) -> None:
    assert LIB is not None
    gen = torch.Generator().manual_seed(n)
    k = 512
    raw = _q4_k_raw(n, k, gen)
    groups = int4_groups(raw, T.Q4_K, (n, k))
    assert groups is not None
    plain = native.pack_q4(groups.q, groups.scale, groups.offset)
    factored = native.pack_q4_super(groups.q, groups.scale, groups.offset)
    assert factored is not None and factored.scale.dtype == torch.uint8
    assert factored.nbytes < 0.8 * plain.nbytes
    ref_w = _reference(raw, n, k)
    bias = torch.randn(n, generator=gen)
    before = LIB.onecall_set_avx512(-1)
    try:
        for m in (1, 2, 3, 5, 9, 70):
            x = torch.randn(m, k, generator=gen)
            for b in (None, bias):
                ref = x.double() @ ref_w.T + (0 if b is None else b.double())
                for wide in (0, 1) if _AVX512 else (0,):
                    LIB.onecall_set_avx512(wide)
                    y = native.q4_gemm(LIB, x, factored, b, 2)
                    assert torch.equal(y, native.q4_gemm(LIB, x, plain, b, 2)), (m, wide, b is None)
                    assert bool(((y.double() - ref).abs() <= _bound(x, ref_w)).all()), (m, wide)
    finally:
        LIB.onecall_set_avx512(before)


def test_only_exact_factors_are_used() -> None:
    gen = torch.Generator().manual_seed(1)
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale, offset = torch.rand(n, k // 32, generator=gen) + 0.1, -torch.rand(n, k // 32, generator=gen)
    # random float32: no d x 8-bit factor reproduces them
    assert native.pack_q4_super(q, scale, offset) is None
    # products that would factor, but K = 288 is not whole super-blocks of 8 groups
    d, sc = (
        torch.rand(n, 1, generator=gen).half().float(),
        torch.randint(0, 64, (n, 9), generator=gen).float(),
    )
    q9 = torch.randint(0, 16, (n, 288), generator=gen, dtype=torch.uint8)
    assert native.pack_q4_super(q9, d * sc, -d * sc) is None
    raw = _q4_k_raw(n, k, gen)
    g = int4_groups(raw, T.Q4_K, (n, k))
    assert g is not None
    assert pack_q4_groups(g, super_blocks=True).scale.dtype == torch.uint8
    assert pack_q4_groups(g).scale.dtype == torch.float32  # tables that rows are gathered from keep float32
    assert pack_q4_groups(g, act8=True, super_blocks=True).scale.dtype == torch.float32  # q4a8 reads float32


def test_kernel_refuses_factors_for_k_not_multiple_of_256() -> None:
    assert LIB is not None
    n, k = 16, 288
    x, y = torch.randn(1, k), torch.empty(1, n)
    qs, table = torch.zeros(1, k // 32, 256, dtype=torch.uint8), torch.zeros(1, 1, 384, dtype=torch.uint8)
    rc = LIB.onecall_q4_gemm(
        x.data_ptr(), 1, k, qs.data_ptr(), table.data_ptr(), None, n, None, y.data_ptr(), 1, 2
    )
    assert rc == -2


def test_decode_step_passes_the_factors_mode() -> None:
    """The one-call decode step hands a factored part to onecall_q4_gemm with f16 = 2 (kernels.h's Q4Weight),
    a float32 one with 0: the wiring the bitwise checks above rely on for the step."""
    gen = torch.Generator().manual_seed(2)
    n, k = 16, 256
    g = int4_groups(_q4_k_raw(n, k, gen), T.Q4_K, (n, k))
    assert g is not None
    factored, plain = pack_q4_groups(g, super_blocks=True), pack_q4_groups(g)
    assert _part(factored, 0, n, k).f16 == 2 and _part(plain, 0, n, k).f16 == 0
