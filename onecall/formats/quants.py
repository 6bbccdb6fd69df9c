"""GGUF block formats -> float tensors, or the stored groups the native kernels multiply by directly.

Dequantization is written from ggml's block layouts (ggml-quants.c's dequantize_row_* operation
order, so results are bit-exact). The `gguf` package's numpy `gguf.quants.dequantize` is the oracle
in tests/formats/test_gguf.py; we do not call it at load time because it is ~6x slower here (4.2 s vs
0.65 s for SmolLM2-135M on one core), which alone would break the 5 s cold-start goal. Torch ops also
run on the model's device.

The stored forms (StoredGroups), one per kernel family (kernels/cpu/fast_linear.py packs them):

| container      | w[r, c] =                     | from                                                |
|----------------|-------------------------------|-----------------------------------------------------|
| Int4Groups     | q * scale + offset, q 0..15   | Q4_0, Q4_1, Q4_K (groups of 32)                     |
| Int5Groups     | q * scale + offset, q 0..31   | Q5_0, Q5_1, Q5_K (groups of 32)                     |
| Int4CodeGroups | codebook[q] * scale, q 0..15  | IQ4_NL, IQ4_XS (32; kvalues_iq4nl), MXFP4 (32; e2m1) |
| Int8Groups     | q * scale, q int8             | Q8_0 (32); Q6_K, Q3_K (16: int8_groups only)        |
| KQuantGroups   | (d sc) (q - z) [- dmin m]     | Q6_K, Q3_K, Q2_K (their codes, per 16; d per 256)   |
| HalfWeights    | float(value)                  | F16, BF16 (2-D weights)                             |

F32 has no stored form: it is expanded to float. Each stored form expands to exactly ggml's dequantization, bit for bit
(Q4_0's q * d + (-8 d) equals (q - 8) * d: a float16 d times a small integer is exact in float32, and so
is their sum), which tests/formats/test_stored_groups.py checks against gguf.quants.dequantize.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import torch

from onecall.errors import UnsupportedModelError
from onecall.formats.ggml_types import GGML_BLOCK_SIZES, GGMLType

T = GGMLType

# Each function takes blocks (num_blocks, type_size) uint8 and returns (num_blocks,
# block_size) float32, with ggml-quants.c's dequantize_row_* float32 operation order
# (so results are bit-exact). Bit twiddling stays in uint8; float math runs in place:
# on small CPUs fresh allocations and extra passes, not arithmetic, dominate.


def _f16(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """`count` consecutive f16 values at byte `start` of each block -> (num_blocks, count) float32."""
    return blocks[:, start : start + 2 * count].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """(n, c * width) bytes -> (n, c, 2, width): per chunk of `width` bytes, low nibbles then high."""
    chunks = packed.reshape(packed.shape[0], -1, width)
    out = torch.empty(*chunks.shape[:2], 2, width, dtype=torch.uint8)
    torch.bitwise_and(chunks, 0xF, out=out[:, :, 0])
    torch.bitwise_right_shift(chunks, 4, out=out[:, :, 1])
    return out


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, k * 8) bits, little-endian: bit j of a little-endian word is element j
    (numpy's unpackbits: 2x torch's shift-and-mask on the Q5 files' bit planes, a third of their load)."""
    return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), axis=1, bitorder="little"))


def _shifted(packed: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(n, k) bytes -> (n, len(shifts), k): (byte >> shift) & mask, one row per shift."""
    shift = torch.tensor(shifts, dtype=torch.uint8).view(1, -1, 1)
    return (packed.unsqueeze(1) >> shift) & mask


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for a uint8 index of any shape (a uint8 index would be a mask to torch), in slices
    so the int32 copy of the index stays small."""
    flat, out = index.reshape(-1), torch.empty(index.numel(), dtype=table.dtype)
    step = 1 << 22
    for i in range(0, flat.numel(), step):
        torch.index_select(table, 0, flat[i : i + step].int(), out=out[i : i + step])
    return out.view(index.shape)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qs:int8[32]
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qs:u8[16] (element j low nibble, j+16 high)
    return _nibbles(b[:, 2:], 16).flatten(1).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m:f16, qs:u8[16]
    dm = _f16(b, 0, 2)
    return _nibbles(b[:, 4:], 16).flatten(1).float().mul_(dm[:, :1]).add_(dm[:, 1:])


def _q5_32(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 values (n, 32) uint8 in 0..31: nibbles after the u32 at `qh_at`, whose bit j is
    element j's 5th bit."""
    return _nibbles(b[:, qh_at + 4 :], 16).flatten(1) | (_bits(b[:, qh_at : qh_at + 4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qh:u32, qs:u8[16]
    return _q5_32(b, 2).float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m:f16, qh:u32, qs:u8[16]
    dm = _f16(b, 0, 2)
    return _q5_32(b, 4).float().mul_(dm[:, :1]).add_(dm[:, 1:])


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d * scale and dmin * min for the 8 sub-blocks of 32, each (n, 8, 1). The 12 bytes at
    offset 4 pack 6-bit values: sub-blocks 0-3 in the low 6 bits of bytes 0-7, sub-blocks 4-7
    as a nibble in bytes 8-11 plus the top 2 bits of bytes 0-7 (ggml's get_scale_min_k4)."""
    s = b[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    d_dmin = _f16(b, 0, 2)
    return (d_dmin[:, :1] * sc.float()).unsqueeze(-1), (d_dmin[:, 1:] * mn.float()).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin:f16, scales:u8[12], qs:u8[128]
    scale, offset = _k4_scales(b)
    # each 32-byte chunk c holds sub-block 2c (low nibbles) and 2c+1 (high nibbles)
    q = _nibbles(b[:, 16:], 32).view(-1, 8, 32).float()
    return q.mul_(scale).sub_(offset).flatten(1)


def _q5_k_values(b: torch.Tensor) -> torch.Tensor:
    """Q5_K values (n, 8, 32) uint8 in 0..31, per sub-block: bit s of qh[l] is the 5th bit of element
    l of sub-block s; the nibbles as Q4_K's."""
    high = _shifted(b[:, 16:48], list(range(8)), 1)
    return _nibbles(b[:, 48:], 32).view(-1, 8, 32) | (high << 4)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]
    scale, offset = _k4_scales(b)
    return _q5_k_values(b).float().mul_(scale).sub_(offset).flatten(1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # scales:u8[16], qs:u8[64], d, dmin:f16
    """Per 16: d * (scale & 15) * q - dmin * (scale >> 4), q in 0..3: element 128h + 32s + l is bits
    2s..2s+1 of qs[32h + l]."""
    sc, dm = b[:, :16], _f16(b, 80, 2)
    q = _shifted(b[:, 16:80].reshape(-1, 32), [0, 2, 4, 6], 3).view(-1, 16, 16).float()
    scale = (dm[:, :1] * (sc & 0xF).float()).unsqueeze(-1)
    offset = (dm[:, 1:] * (sc >> 4).float()).unsqueeze(-1)
    return q.mul_(scale).sub_(offset).flatten(1)


def _codes_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks -> codes (n, 256) uint8 in 0..63 (the value is code - 32): each 128-element half h
    uses ql[64h:64h+64] and qh[32h:32h+32]; element 32k + l of the half takes nibble (k >= 2) of
    ql[l + 32 (k % 2)] and 2-bit pair k of qh[l]."""
    low4 = _nibbles(b[:, :128].reshape(-1, 64), 32).transpose(1, 2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high2 = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    return (low4 | (high2 << 4)).view(-1, 256)


def _codes_q3_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks -> (codes (n, 256) uint8 in 0..7, the value code - 4; sub-scales s - 32 (n, 16)
    int8): _int8_q3_k's bits, the high bit kept as bit 2 of the code."""
    low = _shifted(b[:, 32:96].reshape(-1, 32), [0, 2, 4, 6], 3).view(-1, 256)
    high = _shifted(b[:, :32], list(range(8)), 1).view(-1, 256)
    sc = b[:, 96:108]
    lo = _shifted(sc[:, :8], [0, 4], 0xF).flatten(1)
    hi = _shifted(sc[:, 8:12], [0, 2, 4, 6], 3).flatten(1)
    return low | (high << 2), ((lo | (hi << 4)).view(torch.int8) - 32)


def _int8_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> (q (n, 256) int8 in [-32, 31], scale (n, 16) float32), w = q * scale per 16.
    Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]; element 32k + l of the half
    takes nibble (k >= 2) of ql[l + 32 (k % 2)] and 2-bit pair k of qh[l]."""
    low4 = _nibbles(b[:, :128].reshape(-1, 64), 32).transpose(1, 2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high2 = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = (low4 | (high2 << 4)).view(-1, 256).view(torch.int8) - 32
    return q, _f16(b, 208) * b[:, 192:208].view(torch.int8).float()


def _int8_q3_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks (hmask:u8[32], qs:u8[64], scales:u8[12], d:f16) -> (q (n, 256) int8 in -4..3, scale
    (n, 16) float32 = d * (s - 32)) per 16. Element 128h + 32s + l takes bits 2s..2s+1 of qs[32h + l],
    minus 4 unless bit e // 32 of hmask[e % 32] is set; the 6-bit scales are low nibbles (scales 0-7:
    bytes 0-7 low, 8-15: bytes 0-7 high) with 2 high bits from bytes 8-11 (scale 4s + j: bits 2s.. of
    byte 8 + j)."""
    low = _shifted(b[:, 32:96].reshape(-1, 32), [0, 2, 4, 6], 3).view(-1, 256)
    high = _shifted(b[:, :32], list(range(8)), 1).view(-1, 256)
    q = low.view(torch.int8) - ((1 - high) << 2).view(torch.int8)
    sc = b[:, 96:108]
    lo = _shifted(sc[:, :8], [0, 4], 0xF).flatten(1)
    hi = _shifted(sc[:, 8:12], [0, 2, 4, 6], 3).flatten(1)
    return q, _f16(b, 108) * ((lo | (hi << 4)).float() - 32)


# IQ4_NL's (and IQ4_XS's) non-linear codebook, and MXFP4's e2m1 values doubled (so they are integers:
# the block's scale is halved to match), as ggml-common.h's kvalues_iq4nl and kvalues_mxfp4
_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.int8)  # fmt: skip
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
# Int4CodeGroups' codebooks by name, in the order of the native kernels' numbers (csrc/codebooks.h)
CODEBOOKS: dict[str, torch.Tensor] = {"iq4nl": _IQ4_VALUES, "mxfp4": _MXFP4_VALUES}


def _codes_iq4_nl(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks (d:f16, qs:u8[16], element j low nibble, j + 16 high) -> codes (n, 32) 0..15, d."""
    return _nibbles(b[:, 2:], 16).flatten(1), _f16(b, 0)


def _int8_iq4_nl(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks -> codebook values, d."""
    codes, d = _codes_iq4_nl(b)
    return _lookup(_IQ4_VALUES, codes), d


def _codes_iq4_xs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS blocks (d:f16, scales_h:u16, scales_l:u8[4], qs:u8[128]) -> codes (n, 256) 0..15, scale
    (n, 8) = d * (s - 32) per 32 (exact in float32: 11 bits times 6): sub-block i's 6-bit s is nibble i
    of scales_l plus bits 2i, 2i + 1 of scales_h; its 16 bytes of qs hold elements 0-15 (low nibbles)
    and 16-31 (high)."""
    scales_h = b[:, 2].int() | (b[:, 3].int() << 8)
    high = (scales_h.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    low = _shifted(b[:, 4:8], [0, 4], 0xF).transpose(1, 2).flatten(1)
    scale = _f16(b, 0) * ((low.int() | (high << 4)) - 32).float()
    return _nibbles(b[:, 8:], 16).flatten(1), scale


def _int8_iq4_xs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS blocks -> codebook values (n, 256), scale (n, 8)."""
    codes, scale = _codes_iq4_xs(b)
    return _lookup(_IQ4_VALUES, codes), scale


def _codes_mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks (e:u8, qs:u8[16] as IQ4_NL's) -> codes (n, 32) 0..15 into _MXFP4_VALUES, 2^(e - 128)."""
    return _nibbles(b[:, 1:], 16).flatten(1), _e8m0_half(b[:, :1])


def _int8_mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks -> doubled e2m1 values, 2^(e - 128)."""
    codes, scale = _codes_mxfp4(b)
    return _lookup(_MXFP4_VALUES, codes), scale


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) float32: ggml's e8m0_to_fp32_half, built from its bits
    (subnormal for e < 2)."""
    e = e.int()
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def mxfp4_int8_groups(blocks: torch.Tensor, scales: torch.Tensor) -> Int8Groups | None:
    """A checkpoint's MXFP4 weight as transformers stores it, blocks (rows, G, 16) uint8 (value 2j of a
    group in the low nibble of byte j, 2j + 1 in the high one) and scales (rows, G) uint8 -> exact int8
    groups of 32 (doubled e2m1 values, 2^(e - 128)); None where a scale is 255 (NaN in the MX spec: no
    finite group stands for it). mxfp4_code_groups keeps the codes instead (what the loader uses)."""
    codes = mxfp4_code_groups(blocks, scales)
    if codes is None:
        return None
    return Int8Groups(_lookup(_MXFP4_VALUES, codes.q), codes.scale, 32)


def mxfp4_code_groups(blocks: torch.Tensor, scales: torch.Tensor) -> Int4CodeGroups | None:
    """The same MXFP4 weight as its own 4-bit codes, Int4CodeGroups with the "mxfp4" codebook and the
    same scales (a GGUF's MXFP4 has this form: the native iq4 kernel runs it on half the int8 groups'
    bytes); None where a scale is 255."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise UnsupportedModelError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() != 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise UnsupportedModelError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not (rows, G, 16), (rows, G)"
        )
    if bool((scales == 255).any()):
        return None
    rows, groups = scales.shape
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, groups * 32)
    return Int4CodeGroups(codes, _e8m0_half(scales).contiguous(), codebook="mxfp4")


# type -> (to int8 values and scales per block, group size)
_INT8: dict[T, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], int]] = {
    T.Q6_K: (_int8_q6_k, 16), T.Q3_K: (_int8_q3_k, 16), T.IQ4_NL: (_int8_iq4_nl, 32),
    T.IQ4_XS: (_int8_iq4_xs, 32), T.MXFP4: (_int8_mxfp4, 32),
}  # fmt: skip


def _from_int8(kind: T) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dequantization of an int8-group type: float(q) * scale, ggml's order for each of them."""
    convert, group = _INT8[kind]

    def run(b: torch.Tensor) -> torch.Tensor:
        q, scale = convert(b)
        return q.view(b.shape[0], -1, group).float().mul_(scale.unsqueeze(-1)).flatten(1)

    return run


_FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
_BLOCK_DEQUANT: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q2_K: _q2_k, **{t: _from_int8(t) for t in _INT8},
}  # fmt: skip
SUPPORTED_QUANT_TYPES = frozenset(_FLOAT_TYPES) | frozenset(_BLOCK_DEQUANT)


# ---------------------------------------------------------------- stored forms

_A = TypeVar("_A", bound="_AffineGroups")


@dataclass(frozen=True)
class _AffineGroups:
    """w[r, c] = q[r, c] * scale[r, g] + offset[r, g] with g = c // group_size, q unsigned in 0 ..
    2^bits - 1 (Int4Groups, Int5Groups)."""

    bits: ClassVar[int]
    q: torch.Tensor  # (rows, cols) uint8 in [0, 2^bits)
    scale: torch.Tensor  # (rows, cols // group_size) float32
    offset: torch.Tensor  # (rows, cols // group_size) float32
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight these groups stand for."""
        rows, cols = self.q.shape
        w = self.q.view(rows, -1, self.group_size).float()  # in place from here: one pass, no temporaries
        return w.mul_(self.scale.unsqueeze(-1)).add_(self.offset.unsqueeze(-1)).view(rows, cols)

    @classmethod
    def cat(cls: type[_A], groups: list[_A]) -> _A:
        """Stack the row blocks of separately stored projections (q, k, v / gate, up), in order."""
        assert groups and all(type(g) is cls for g in groups), f"only {cls.__name__} stack into one"
        assert len({g.group_size for g in groups}) == 1, "one group size per fused weight"
        if len(groups) == 1:
            return groups[0]
        return cls(
            torch.cat([g.q for g in groups]),
            torch.cat([g.scale for g in groups]),
            torch.cat([g.offset for g in groups]),
            groups[0].group_size,
        )

    def select_rows(self: _A, index: torch.Tensor | slice) -> _A:
        return type(self)(self.q[index], self.scale[index], self.offset[index], self.group_size)


@dataclass(frozen=True)
class Int4Groups(_AffineGroups):
    """A 4-bit weight as ggml stores it, before expansion: q in [0, 15]. Q4_0, Q4_1 and Q4_K all have
    this form with groups of 32 (Q4_K's super-block scales are folded into per-group scale/offset in
    float32), so a kernel that multiplies by int4 groups directly (kernels/cpu/fast_linear.py) runs
    these files' own weights."""

    bits: ClassVar[int] = 4


@dataclass(frozen=True)
class Int5Groups(_AffineGroups):
    """A 5-bit weight as ggml stores it: q in [0, 31], groups of 32. Q5_0 is d * (q - 16) (scale d,
    offset -16 d, both exact in float16), Q5_1 d * q + m, Q5_K d * sc * q - dmin * m per 32-element
    sub-block (scale and offset the float32 products ggml forms). The native q5 kernel multiplies by
    them directly: the nibbles as the q4 kernel packs them plus a plane of 5th bits."""

    bits: ClassVar[int] = 5


@dataclass(frozen=True)
class Int8Groups:
    """A weight as signed integer groups with one scale each: w[r, c] = q[r, c] * scale[r, c // group_size].
    Q8_0 is this with groups of 32 (the stored float16 scales, widened); Q6_K with groups of 16 (q - 32
    in [-32, 31], scale = the super-block's d times the sub-block's int8 scale: a product exact in
    float32); Q3_K with groups of 16 (q in -4..3, d * (s - 32)); IQ4_NL and IQ4_XS with groups of 32 (the
    codebook's int8 values, d or d * (s - 32), and MXFP4 with groups of 32 (e2m1 doubled, 2^(e - 128)):
    int8_groups converts them, but stored_groups keeps their codes, Int4CodeGroups).
    The native int8 kernel (FastLMHead, FastLinear) multiplies by these directly."""

    q: torch.Tensor  # (rows, cols) int8
    scale: torch.Tensor  # (rows, cols // group_size) float32
    group_size: int = 32

    def __post_init__(self) -> None:  # another form's values taken for int8 ones would be silently wrong
        assert self.q.dtype == torch.int8, f"Int8Groups holds int8 values, not {self.q.dtype}"

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight these groups stand for (bit-exact with ggml's dequantize)."""
        rows, cols = self.q.shape
        w = self.q.view(rows, -1, self.group_size).float()
        return w.mul_(self.scale.unsqueeze(-1)).view(rows, cols)

    @staticmethod
    def cat(groups: list[Int8Groups]) -> Int8Groups:
        """Stack row blocks (q, k, v / gate, up), in order; one group size."""
        assert groups and len({g.group_size for g in groups}) == 1, "one group size per fused weight"
        if len(groups) == 1:
            return groups[0]
        return Int8Groups(torch.cat([g.q for g in groups]), torch.cat([g.scale for g in groups]),
                          groups[0].group_size)  # fmt: skip

    def select_rows(self, index: torch.Tensor | slice) -> Int8Groups:
        return Int8Groups(self.q[index], self.scale[index], self.group_size)


@dataclass(frozen=True)
class Int4CodeGroups:
    """A weight stored as 4-bit codes indexing a 16-value int8 codebook (CODEBOOKS[codebook]) with one
    scale per group of 32, w[r, c] = CODEBOOKS[codebook][q[r, c]] * scale[r, c // 32]: IQ4_NL and IQ4_XS
    with "iq4nl" (kvalues_iq4nl, CODEBOOK; the block's d, or d * (s - 32)), MXFP4 with "mxfp4" (e2m1
    doubled; 2^(e - 128), ggml's halved E8M0). The native iq4 kernel multiplies by the codes directly
    (half the bytes of their int8 values), its table chosen by the codebook."""

    CODEBOOK: ClassVar[torch.Tensor] = _IQ4_VALUES  # IQ4's, the default codebook
    q: torch.Tensor  # (rows, cols) uint8 in [0, 16)
    scale: torch.Tensor  # (rows, cols // 32) float32
    group_size: int = 32
    codebook: str = "iq4nl"  # a key of CODEBOOKS

    def __post_init__(self) -> None:
        assert self.q.dtype == torch.uint8, f"Int4CodeGroups holds uint8 codes, not {self.q.dtype}"
        assert self.group_size == 32, "IQ4 codes come in groups of 32"
        assert self.codebook in CODEBOOKS, f"no codebook {self.codebook!r}"

    @property
    def values(self) -> torch.Tensor:
        """(16,) int8: the codebook the codes index."""
        return CODEBOOKS[self.codebook]

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight (bit-exact with ggml's dequantize: one float32 product)."""
        rows, cols = self.q.shape
        w = _lookup(self.values, self.q).view(rows, -1, self.group_size).float()
        return w.mul_(self.scale.unsqueeze(-1)).view(rows, cols)

    @staticmethod
    def cat(groups: list[Int4CodeGroups]) -> Int4CodeGroups:
        """Stack row blocks (q, k, v / gate, up), in order; one codebook."""
        assert groups and len({g.codebook for g in groups}) == 1, "one codebook per fused weight"
        if len(groups) == 1:
            return groups[0]
        return Int4CodeGroups(torch.cat([g.q for g in groups]), torch.cat([g.scale for g in groups]),
                              codebook=groups[0].codebook)  # fmt: skip

    def select_rows(self, index: torch.Tensor | slice) -> Int4CodeGroups:
        return Int4CodeGroups(self.q[index], self.scale[index], self.group_size, self.codebook)


@dataclass(frozen=True)
class HalfWeights:
    """A 2-D weight the file stored as F16 or BF16, kept in that dtype: the native half GEMM reads it
    (widening each value to float32 exactly), so no float32 copy of it is made."""

    values: torch.Tensor  # (rows, cols) float16 or bfloat16

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.values.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        return self.values.float()

    @staticmethod
    def cat(parts: list[HalfWeights]) -> HalfWeights:
        assert parts and len({p.values.dtype for p in parts}) == 1, "one dtype per fused weight"
        return parts[0] if len(parts) == 1 else HalfWeights(torch.cat([p.values for p in parts]))

    def select_rows(self, index: torch.Tensor | slice) -> HalfWeights:
        return HalfWeights(self.values[index])


@dataclass(frozen=True)
class KQuantGroups:
    """A Q6_K, Q3_K or Q2_K weight as stored: its codes on their own bits (`bits` 6, 3, 2), an int8
    sub-scale per 16 columns and the super-block's float16 d per 256 (Q2_K: also a 4-bit min per 16 and
    dmin per 256): w = (d * sc) * (q - z) with z = ZERO[bits] (Q6_K: 32, Q3_K: 4), Q2_K w = (d * sc) * q -
    dmin * m. d * sc and dmin * m are exact float32 products (11 bits times at most 8), so this is ggml's
    dequantization bit for bit. The native kq kernel (csrc/gemm_kq.c) multiplies by the codes directly:
    6.56, 3.56 and 3.13 bits a weight where int8 groups of 16 took 10 and float32 32."""

    ZERO: ClassVar[dict[int, int]] = {6: 32, 3: 4, 2: 0}
    bits: int
    q: torch.Tensor  # (rows, cols) uint8 codes in [0, 2^bits)
    sub_scale: torch.Tensor  # (rows, cols // 16) int8
    d: torch.Tensor  # (rows, cols // 256) float32, each a float16 value
    sub_min: torch.Tensor | None = None  # Q2_K: (rows, cols // 16) int8 in 0..15
    dmin: torch.Tensor | None = None  # Q2_K: (rows, cols // 256) float32, each a float16 value

    def __post_init__(self) -> None:
        assert self.bits in self.ZERO, f"K-quant codes of 6, 3 or 2 bits, not {self.bits}"
        assert self.q.dtype == torch.uint8 and self.sub_scale.dtype == torch.int8
        assert (self.sub_min is not None) == (self.dmin is not None) == (self.bits == 2), "mins are Q2_K's"

    group_size: ClassVar[int] = 16

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight (ggml's operations: one product, Q2_K's then one difference)."""
        rows, cols = self.q.shape
        scale = self.d.repeat_interleave(16, dim=1).mul_(self.sub_scale.float()).unsqueeze(-1)
        w = self.q.view(rows, -1, 16).float().sub_(self.ZERO[self.bits]).mul_(scale)
        if self.sub_min is not None and self.dmin is not None:
            w.sub_(self.dmin.repeat_interleave(16, dim=1).mul_(self.sub_min.float()).unsqueeze(-1))
        return w.view(rows, cols)

    @staticmethod
    def cat(groups: list[KQuantGroups]) -> KQuantGroups:
        """Stack row blocks (q, k, v / gate, up), in order; one type."""
        assert groups and len({g.bits for g in groups}) == 1, "one K-quant type per fused weight"
        if len(groups) == 1:
            return groups[0]
        mins = groups[0].bits == 2
        return KQuantGroups(
            groups[0].bits, *(torch.cat([g.q for g in groups]), torch.cat([g.sub_scale for g in groups]),
                              torch.cat([g.d for g in groups])),
            torch.cat([g.sub_min for g in groups if g.sub_min is not None]) if mins else None,
            torch.cat([g.dmin for g in groups if g.dmin is not None]) if mins else None,
        )  # fmt: skip

    def select_rows(self, index: torch.Tensor | slice) -> KQuantGroups:
        return KQuantGroups(
            self.bits, self.q[index], self.sub_scale[index], self.d[index],
            None if self.sub_min is None else self.sub_min[index], None if self.dmin is None else self.dmin[index],
        )  # fmt: skip


# a checkpoint's own stored weights, kept for the fast kernels (by Hugging Face name)
StoredGroups = Int4Groups | Int5Groups | Int8Groups | Int4CodeGroups | KQuantGroups | HalfWeights


def cat_rows(parts: list[StoredGroups]) -> StoredGroups | None:
    """Row blocks stored in one form (container, group size, dtype) stacked into one, in order (q, k, v /
    gate, up of one projection); None when they are not all one form."""
    first = parts[0]
    if isinstance(first, HalfWeights):
        halves = [p for p in parts if isinstance(p, HalfWeights) and p.values.dtype == first.values.dtype]
        return HalfWeights.cat(halves) if len(halves) == len(parts) else None
    if any(type(p) is not type(first) or p.group_size != first.group_size for p in parts):  # type: ignore[union-attr]
        return None
    if isinstance(first, Int8Groups):
        return Int8Groups.cat(parts)  # type: ignore[arg-type]
    if isinstance(first, Int4CodeGroups):
        same = all(p.codebook == first.codebook for p in parts)  # type: ignore[union-attr]
        return Int4CodeGroups.cat(parts) if same else None  # type: ignore[arg-type]
    if isinstance(first, KQuantGroups):
        same = all(isinstance(p, KQuantGroups) and p.bits == first.bits for p in parts)
        return KQuantGroups.cat(parts) if same else None  # type: ignore[arg-type]
    return type(first).cat(parts)  # type: ignore[arg-type]


def _groups_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16).flatten(1), d, d * -8


def _groups_q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dm = _f16(b, 0, 2)
    return _nibbles(b[:, 4:], 16).flatten(1), dm[:, :1], dm[:, 1:]


def _groups_q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, offset = _k4_scales(b)  # (n, 8, 1): one per 32-element sub-block
    return _nibbles(b[:, 16:], 32).reshape(-1, 32), scale.reshape(-1, 1), -offset.reshape(-1, 1)


def _groups_q5_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(b, 0)
    return _q5_32(b, 2), d, d * -16


def _groups_q5_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dm = _f16(b, 0, 2)
    return _q5_32(b, 4), dm[:, :1], dm[:, 1:]


def _groups_q5_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, offset = _k4_scales(b)
    return _q5_k_values(b).reshape(-1, 32), scale.reshape(-1, 1), -offset.reshape(-1, 1)


# type -> its container and the (q, scale, offset) per group of 32 of its blocks
_AFFINE: dict[T, tuple[type[_AffineGroups], Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]] = {
    T.Q4_0: (Int4Groups, _groups_q4_0), T.Q4_1: (Int4Groups, _groups_q4_1), T.Q4_K: (Int4Groups, _groups_q4_k),
    T.Q5_0: (Int5Groups, _groups_q5_0), T.Q5_1: (Int5Groups, _groups_q5_1), T.Q5_K: (Int5Groups, _groups_q5_k),
}  # fmt: skip


def _affine_groups(
    raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...], bits: int
) -> _AffineGroups | None:
    if ggml_type not in _AFFINE or len(shape) != 2 or _AFFINE[ggml_type][0].bits != bits:
        return None
    container, decode = _AFFINE[ggml_type]
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    q, scale, offset = decode(raw.view(-1, type_size))  # per group of 32
    rows, cols = shape
    return container(q.reshape(rows, cols), scale.reshape(rows, -1), offset.reshape(rows, -1))


def int4_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int4Groups | None:
    """Raw data of a 2-D 4-bit tensor (Q4_0/Q4_1/Q4_K) -> its Int4Groups (no expansion), or None for
    other types."""
    groups = _affine_groups(raw, ggml_type, shape, 4)
    assert groups is None or isinstance(groups, Int4Groups)
    return groups


def int5_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int5Groups | None:
    """Raw data of a 2-D 5-bit tensor (Q5_0/Q5_1/Q5_K) -> its Int5Groups, or None for other types."""
    groups = _affine_groups(raw, ggml_type, shape, 5)
    assert groups is None or isinstance(groups, Int5Groups)
    return groups


def int8_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int8Groups | None:
    """Raw data of a 2-D tensor of a type that is exactly int8 groups (Q8_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS,
    MXFP4) -> its Int8Groups (one int8 per value), or None for other types (stored_groups keeps the codes
    of IQ4_NL, IQ4_XS and MXFP4 instead)."""
    if (ggml_type not in _INT8 and ggml_type != T.Q8_0) or len(shape) != 2:
        return None
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    blocks = raw.view(-1, type_size)
    rows, cols = shape
    if ggml_type == T.Q8_0:  # the int8 values after 2 bytes of float16 scale, as they are
        return Int8Groups(
            blocks[:, 2:].contiguous().view(torch.int8).view(rows, cols), _f16(blocks, 0).view(rows, -1)
        )
    convert, group = _INT8[ggml_type]
    q, scale = convert(blocks)
    return Int8Groups(q.reshape(rows, cols), scale.reshape(rows, cols // group), group)


# type -> (its codes and scales per group of 32, the codebook they index)
_CODES: dict[T, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], str]] = {
    T.IQ4_NL: (_codes_iq4_nl, "iq4nl"), T.IQ4_XS: (_codes_iq4_xs, "iq4nl"), T.MXFP4: (_codes_mxfp4, "mxfp4"),
}  # fmt: skip


def int4_code_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int4CodeGroups | None:
    """Raw data of a 2-D IQ4_NL, IQ4_XS or MXFP4 tensor -> its Int4CodeGroups (the codes, not their
    values, and the codebook they index), or None for other types."""
    if ggml_type not in _CODES or len(shape) != 2:
        return None
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    decode, codebook = _CODES[ggml_type]
    codes, scale = decode(raw.view(-1, type_size))
    rows, cols = shape
    return Int4CodeGroups(
        codes.reshape(rows, cols).contiguous(),
        scale.reshape(rows, cols // 32).contiguous(),
        codebook=codebook,
    )


def _kquant_q6_k(b: torch.Tensor) -> KQuantGroups:  # ql:u8[128], qh:u8[64], scales:i8[16], d:f16
    return KQuantGroups(6, _codes_q6_k(b), b[:, 192:208].view(torch.int8), _f16(b, 208))


def _kquant_q3_k(b: torch.Tensor) -> KQuantGroups:  # hmask:u8[32], qs:u8[64], scales:u8[12], d:f16
    codes, sub_scale = _codes_q3_k(b)
    return KQuantGroups(3, codes, sub_scale, _f16(b, 108))


def _kquant_q2_k(b: torch.Tensor) -> KQuantGroups:  # scales:u8[16], qs:u8[64], d, dmin:f16
    """_q2_k's codes; the 4-bit sub-scales (low nibbles) and mins (high ones) as int8."""
    codes = _shifted(b[:, 16:80].reshape(-1, 32), [0, 2, 4, 6], 3).view(-1, 256)
    dm = _f16(b, 80, 2)
    sc = b[:, :16]
    return KQuantGroups(
        2, codes, (sc & 0xF).view(torch.int8), dm[:, :1], (sc >> 4).view(torch.int8), dm[:, 1:]
    )


_KQUANT: dict[T, Callable[[torch.Tensor], KQuantGroups]] = {
    T.Q6_K: _kquant_q6_k, T.Q3_K: _kquant_q3_k, T.Q2_K: _kquant_q2_k,
}  # fmt: skip


def kquant_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> KQuantGroups | None:
    """Raw data of a 2-D Q6_K, Q3_K or Q2_K tensor -> its KQuantGroups (the codes, not their int8 values
    or floats), or None for other types."""
    if ggml_type not in _KQUANT or len(shape) != 2:
        return None
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    g = _KQUANT[ggml_type](raw.view(-1, type_size))  # per block of 256
    rows, cols = shape

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, -1).contiguous()

    return KQuantGroups(
        g.bits, per_row(g.q), per_row(g.sub_scale), per_row(g.d),
        None if g.sub_min is None else per_row(g.sub_min), None if g.dmin is None else per_row(g.dmin),
    )  # fmt: skip


def half_weights(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> HalfWeights | None:
    """Raw data of a 2-D F16 or BF16 tensor -> HalfWeights (a view of `raw`: no copy), else None."""
    if ggml_type not in (T.F16, T.BF16) or len(shape) != 2:
        return None
    return HalfWeights(raw.view(_FLOAT_TYPES[ggml_type]).view(shape))


def stored_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> StoredGroups | None:
    """Raw data of a 2-D tensor -> the stored form a native kernel runs (the table above), or None
    where there is none (F32, a tensor that is not 2-D): it is expanded to float."""
    return (
        int4_groups(raw, ggml_type, shape)
        or int5_groups(raw, ggml_type, shape)
        or kquant_groups(raw, ggml_type, shape)
        or int4_code_groups(raw, ggml_type, shape)
        or int8_groups(raw, ggml_type, shape)
        or half_weights(raw, ggml_type, shape)
    )


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw uint8 tensor data of one tensor -> a new tensor of `shape` (torch order) in `dtype`."""
    if ggml_type in _FLOAT_TYPES:  # no float32 detour: bf16 -> bf16 is a plain copy
        return raw.view(_FLOAT_TYPES[ggml_type]).reshape(shape).to(dtype, copy=True)
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    values = _BLOCK_DEQUANT[ggml_type](raw.view(-1, type_size))  # (num_blocks, block_size)
    return values.reshape(shape).to(dtype)
