"""The AVX-512 tiles of the 16-bit float GEMM (csrc/gemm_half.c) against its AVX2 tiles and a float64
matmul, F16 and BF16 weights in the h16 layout (native.pack_half).

What is checked, and with what tolerance:
* bit for bit: the same packed weights and activations through the AVX-512 tiles (onecall_set_avx512(1))
  and the AVX2 tiles (onecall_set_avx512(0)) give torch.equal outputs. Both compute every output as
  acc = fma(w[n, k], x[m, k], acc) over k in order from 0, then + bias, in float32 (the AVX-512 lanes are
  the AVX2 tile's two registers side by side), so any difference is a bug. M covers one row, every tail
  tile of both paths (2, 3, 5, 7 rows), the AVX-512 tile's 6 rows, 16 and a second 64-row chunk (70); N
  covers one unit (16), a partial unit (85: 6 units, the last 5 rows) and a quad of units plus three
  (112: the tiles of 3 units); K needs no multiple of anything (1, 7, 200).
* against float64 (so two equally wrong paths cannot pass): ref = x @ W^T + b in float64 on the same
  16-bit values widened exactly. A float32 dot product summed in order along K, one rounding per FMA,
  is within gamma_K = K u / (1 - K u) of |x| @ |W|^T (u = 2^-24, Higham's bound for recursive
  summation), and the bias add rounds once more (u (|ref| + |x| @ |W|^T)); the bound below is that.
  The weights include F16 subnormals and large values (F16: near its largest), which must widen exactly.
* batch invariance: each row of an M = 37 call (two threads) equals the same row computed alone (M = 1,
  one thread), on the AVX-512 tiles.
* NaN and infinity in a weight reach exactly the outputs whose dot products they enter, on both paths
  alike: the same NaN positions (and only the expected ones), the same values elsewhere, infinities included.

Skipped where the native kernels are unavailable or the CPU lacks AVX-512 F/BW/VL + VNNI (the switch
that turns the quantized GEMMs' AVX-512 tiles on turns these on too: avx512_gemm_enabled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from onecall.kernels.cpu import native, native_build

LIB = native_build.load()
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
pytestmark = [
    pytest.mark.skipif(
        LIB is None, reason=f"native kernels unavailable: {native_build.unavailable_reason()}"
    ),
    pytest.mark.skipif(
        not set(_AVX512_FLAGS) <= native_build.cpu_flags(), reason="this CPU lacks AVX-512 F/BW/VL + VNNI"
    ),
]
DTYPES = (torch.float16, torch.bfloat16)
ROWS = (1, 2, 3, 5, 6, 7, 16, 70)
SHAPES = ((16, 200), (85, 7), (112, 200), (85, 1))  # (N, K)
U = 2.0**-24  # float32's unit roundoff


@pytest.fixture
def avx512() -> Iterator[Callable[[bool], None]]:
    """set(on): the AVX-512 tiles on or off; the state before the test is put back after it."""
    assert LIB is not None
    before = LIB.onecall_set_avx512(-1)

    def set_avx512(on: bool) -> None:
        assert LIB is not None
        assert LIB.onecall_set_avx512(int(on)) == int(on), "the switch did not take"

    yield set_avx512
    LIB.onecall_set_avx512(before)


def _weights(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(n, k) in dtype: normal values, a few subnormals (F16) and a few near the largest finite value."""
    w = torch.randn(n, k, generator=gen) * 0.1
    w.view(-1)[::97] = 3e-6  # an F16 subnormal (BF16 holds it as a normal number)
    w.view(-1)[5::211] = -6.0e4 if dtype == torch.float16 else -1.0e36
    return w.to(dtype)


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """float64 (M, N): gamma_K (|x| @ |W|^T) for the dot product, u (|ref| + spread + |b|) for the bias add"""
    k = x.shape[1]
    spread = x.double().abs() @ w.double().abs().T
    return k * U / (1 - k * U) * spread + U * (ref.abs() + spread + bias.double().abs())


@pytest.mark.parametrize("dtype", DTYPES, ids=("f16", "bf16"))
def test_avx512_tiles_give_the_avx2_bits_within_the_float32_bound(
    dtype: torch.dtype, avx512: Callable[[bool], None]
) -> None:
    assert LIB is not None
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = _weights(n, k, dtype, gen)
        packed = native.pack_half(w)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m).unsqueeze(1)
            bias = torch.randn(n, generator=gen)
            threads = 1 + m % 2
            avx512(True)
            wide = native.half_gemm(LIB, x, packed, bias, threads)
            avx512(False)
            narrow = native.half_gemm(LIB, x, packed, bias, threads)
            where = f"{dtype} M={m} N={n} K={k}"
            assert torch.equal(wide, narrow), f"{where}: max diff {(wide - narrow).abs().max().item()}"
            ref = x.double() @ w.double().T + bias.double()
            excess = (wide.double() - ref).abs() - _bound(x, w, bias, ref)
            assert excess.max().item() <= 0, f"{where}: {excess.max().item()} over the float32 bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=("f16", "bf16"))
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(
    dtype: torch.dtype, avx512: Callable[[bool], None]
) -> None:
    assert LIB is not None
    gen = torch.Generator().manual_seed(11)
    n, k = 112, 333
    packed = native.pack_half(_weights(n, k, dtype, gen))
    x, bias = torch.randn(37, k, generator=gen), torch.randn(n, generator=gen)
    avx512(True)
    batch = native.half_gemm(LIB, x, packed, bias, 2)
    for m in range(37):
        alone = native.half_gemm(LIB, x[m : m + 1].contiguous(), packed, bias, 1)
        assert torch.equal(alone, batch[m : m + 1]), f"row {m} of 37 differs from the row alone"


@pytest.mark.parametrize("dtype", DTYPES, ids=("f16", "bf16"))
def test_nan_and_infinity_reach_the_same_outputs_on_both_paths(
    dtype: torch.dtype, avx512: Callable[[bool], None]
) -> None:
    assert LIB is not None
    gen = torch.Generator().manual_seed(13)
    n, k = 40, 50
    w = _weights(n, k, dtype, gen)
    w[3, 7], w[20, 0], w[39, 49] = float("nan"), float("inf"), float("-inf")
    packed = native.pack_half(w)
    x = torch.randn(9, k, generator=gen)
    x[4, 0] = 0.0  # inf x 0: NaN in output (4, 20)
    avx512(True)
    wide = native.half_gemm(LIB, x, packed, None, 2)
    avx512(False)
    narrow = native.half_gemm(LIB, x, packed, None, 2)
    assert torch.equal(wide.isnan(), narrow.isnan()) and torch.equal(wide.nan_to_num(), narrow.nan_to_num())
    expected_nan = torch.zeros_like(wide, dtype=torch.bool)
    expected_nan[:, 3] = True
    expected_nan[4, 20] = True
    assert torch.equal(wide.isnan(), expected_nan)
