"""The AVX-512 VNNI tiles of the quantized GEMMs (csrc/gemm_avx512.c) against the AVX2 tiles they replace
on CPUs that have them: q4 (float32 and half scales), q8b (scale groups of 32 and 16), iq4 (IQ4's codebook
and MXFP4's) and q5.

What is checked, and with what tolerance:
* bit for bit: the same packed weights and activations through the AVX-512 tiles (onecall_set_avx512(1))
  and the AVX2 tiles (onecall_set_avx512(0)) give torch.equal outputs, for M in (1, 2, 3, 5, 16, 37, 70)
  (one row, the tail tiles, and a second chunk of Q4_ROW_CHUNK rows), N in (16, 48, 40) (40: a partial
  unit of 16 rows), K in (32, 256, 4096), with and without a bias. Both paths compute a group's dot as
  the same exact int32 and then the same float32 operations per output (gemm_avx512.c), so any other
  difference is a bug.
* against float64 (so two equally wrong paths cannot pass): the q4 kernel's int16-activation bound of
  tests/kernels/test_native_kernels.py, |y - ref| <= sum_g (dx_g / 2) sum_{j in g} |w_j| + 1e-5 (|x| @
  |W|^T) + 1e-6, ref = x @ W^T (+ b) in float64 on the dequantized W, dx_g = absmax / 32767.
* the switch: onecall_set_avx512(-1) reports the state without changing it, and 1 cannot turn the tiles
  on where the CPU lacks AVX-512 VNNI (that is the skip condition here, so only the report is checked).

Skipped where the native kernels are unavailable or the CPU lacks AVX-512 F/BW/VL + VNNI.
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
ROWS = (1, 2, 3, 5, 16, 37, 70)
OUT_FEATURES = (16, 48, 40)
IQ4_CODEBOOK = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
MXFP4_CODEBOOK = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])  # e2m1 doubled

# A weight: (packed form, dequantized (N, K) float64)
Weight = tuple[native.Packed, torch.Tensor]


def _scales(shape: tuple[int, ...], gen: torch.Generator, half: bool) -> torch.Tensor:
    s = torch.rand(shape, generator=gen) * 0.02 + 1e-3
    return s.half() if half else s


def _q4(n: int, k: int, gen: torch.Generator, half: bool) -> Weight:
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale, offset = _scales((n, k // 32), gen, half), -_scales((n, k // 32), gen, half) * 8
    w = q.double() * scale.double().repeat_interleave(32, 1) + offset.double().repeat_interleave(32, 1)
    return native.pack_q4(q, scale, offset), w


def _q5(n: int, k: int, gen: torch.Generator, half: bool) -> Weight:
    q = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.uint8)
    scale, offset = _scales((n, k // 32), gen, half), -_scales((n, k // 32), gen, half) * 16
    w = q.double() * scale.double().repeat_interleave(32, 1) + offset.double().repeat_interleave(32, 1)
    return native.pack_q5(q, scale, offset), w


def _q8b(n: int, k: int, gen: torch.Generator, group_size: int) -> Weight:
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = _scales((n, k // group_size), gen, half=False)
    w = q.double() * scale.double().repeat_interleave(group_size, 1)
    return native.pack_q8_blocked(q, scale, group_size), w


def _iq4(n: int, k: int, gen: torch.Generator, half: bool, codebook: str = "iq4nl") -> Weight:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = _scales((n, k // 32), gen, half).float()  # pack_iq4 keeps half-exact scales as float16
    table = MXFP4_CODEBOOK if codebook == "mxfp4" else IQ4_CODEBOOK
    w = table[codes.long()].double() * scale.double().repeat_interleave(32, 1)
    packed = native.pack_iq4(codes, scale, codebook)
    assert (packed.scale.dtype == torch.float16) == half
    return packed, w


KINDS: dict[str, Callable[[int, int, torch.Generator], Weight]] = {
    "q4-f32": lambda n, k, gen: _q4(n, k, gen, half=False),
    "q4-f16": lambda n, k, gen: _q4(n, k, gen, half=True),
    "q8b-g32": lambda n, k, gen: _q8b(n, k, gen, 32),
    "q8b-g16": lambda n, k, gen: _q8b(n, k, gen, 16),
    "iq4-f32": lambda n, k, gen: _iq4(n, k, gen, half=False),
    "iq4-f16": lambda n, k, gen: _iq4(n, k, gen, half=True),
    "mxfp4-f32": lambda n, k, gen: _iq4(n, k, gen, half=False, codebook="mxfp4"),
    "mxfp4-f16": lambda n, k, gen: _iq4(n, k, gen, half=True, codebook="mxfp4"),
    "q5-f32": lambda n, k, gen: _q5(n, k, gen, half=False),
    "q5-f16": lambda n, k, gen: _q5(n, k, gen, half=True),
}


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


def _activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """(m, k) float32 with rows of different magnitudes and one all-zero group (a zero step)."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, m).unsqueeze(1)
    x[m // 2, :32] = 0
    return x.contiguous()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 (M, N): what the int16 activation steps allow (the module docstring)."""
    step = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 32767
    rounding = (step / 2) @ w.abs().view(w.shape[0], -1, 32).sum(-1).T
    return rounding + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("k", (32, 256, 4096))
@pytest.mark.parametrize("kind", list(KINDS))
def test_avx512_tiles_give_the_avx2_bits(kind: str, k: int, avx512: Callable[[bool], None]) -> None:
    assert LIB is not None
    gen = torch.Generator().manual_seed(k + len(kind))
    for n in OUT_FEATURES:
        packed, w = KINDS[kind](n, k, gen)
        for m in ROWS:
            x = _activations(m, k, gen)
            bias = torch.randn(n, generator=gen) if m % 2 else None
            threads = 1 + m % 2
            avx512(True)
            wide = native.matmul(LIB, x, packed, bias, threads)
            avx512(False)
            narrow = native.matmul(LIB, x, packed, bias, threads)
            where = f"{kind} M={m} N={n} K={k}"
            assert torch.equal(wide, narrow), f"{where}: max diff {(wide - narrow).abs().max().item()}"
            ref = x.double() @ w.T + (0 if bias is None else bias.double())
            excess = (wide.double() - ref).abs() - _bound(x, w)
            assert excess.max().item() <= 0, f"{where}: {excess.max().item()} over the int16 bound"


def test_the_switch_reports_its_state_without_changing_it(avx512: Callable[[bool], None]) -> None:
    assert LIB is not None
    avx512(False)
    assert LIB.onecall_set_avx512(-1) == 0
    avx512(True)
    assert LIB.onecall_set_avx512(-1) == 1
