"""GGUF block formats -> float tensors: vectorized torch dequantization of ggml's quant types.

Written from ggml's block layouts (ggml-quants.c's dequantize_row_* operation
order, so results are bit-exact). The `gguf` package's numpy
`gguf.quants.dequantize` is the oracle in tests/formats/test_gguf.py; we do not call it at
load time because it is ~6x slower here (4.2 s vs 0.65 s for SmolLM2-135M on
one core), which alone would break the 5 s cold-start goal. Torch ops also run
on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    """(n, k) bytes -> (n, k * 8) bits, little-endian: bit j of a little-endian word is element j."""
    return ((packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qs:int8[32]
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qs:u8[16] (element j low nibble, j+16 high)
    return _nibbles(b[:, 2:], 16).flatten(1).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m:f16, qs:u8[16]
    dm = _f16(b, 0, 2)
    return _nibbles(b[:, 4:], 16).flatten(1).float().mul_(dm[:, :1]).add_(dm[:, 1:])


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d:f16, qh:u32 (bit j = 5th bit of element j), qs:u8[16]
    q = _nibbles(b[:, 6:], 16).flatten(1) | (_bits(b[:, 2:6]) << 4)
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m:f16, qh:u32, qs:u8[16]
    dm = _f16(b, 0, 2)
    q = _nibbles(b[:, 8:], 16).flatten(1) | (_bits(b[:, 4:8]) << 4)
    return q.float().mul_(dm[:, :1]).add_(dm[:, 1:])


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


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin:f16, scales:u8[12], qh:u8[32], qs:u8[128]
    scale, offset = _k4_scales(b)
    # bit s of qh[l] is the 5th bit of element l of sub-block s
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = (_nibbles(b[:, 48:], 32).view(-1, 8, 32) | (high << 4)).float()
    return q.mul_(scale).sub_(offset).flatten(1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # ql:u8[128], qh:u8[64], scales:i8[16], d:f16
    q, scale = _int8_q6_k(b)  # 16 groups of 16 elements, one scale each
    return q.view(-1, 16, 16).float().mul_(scale.unsqueeze(-1)).flatten(1)


_FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
_BLOCK_DEQUANT: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}  # fmt: skip
SUPPORTED_QUANT_TYPES = frozenset(_FLOAT_TYPES) | frozenset(_BLOCK_DEQUANT)


@dataclass(frozen=True)
class Int4Groups:
    """A 4-bit weight as ggml stores it, before expansion: w[r, c] = q[r, c] * scale[r, g] + offset[r, g]
    with g = c // group_size. Q4_0, Q4_1 and Q4_K all have this form with groups of 32 (Q4_K's
    super-block scales are folded into per-group scale/offset in float32), so a kernel that
    multiplies by int4 groups directly (kernels/cpu/fast_linear.py) runs these files' own weights.
    """

    q: torch.Tensor  # (rows, cols) uint8 in [0, 15]
    scale: torch.Tensor  # (rows, cols // group_size) float32
    offset: torch.Tensor  # (rows, cols // group_size) float32
    group_size: int = 32

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight these groups stand for."""
        rows, cols = self.q.shape
        w = self.q.view(rows, -1, self.group_size).float()  # in place from here: one pass, no temporaries
        return w.mul_(self.scale.unsqueeze(-1)).add_(self.offset.unsqueeze(-1)).view(rows, cols)

    @staticmethod
    def cat(groups: list[Int4Groups]) -> Int4Groups:
        """Stack the row blocks of separately stored projections (q, k, v / gate, up), in order."""
        assert groups and len({g.group_size for g in groups}) == 1, "one group size per fused weight"
        if len(groups) == 1:
            return groups[0]
        return Int4Groups(
            torch.cat([g.q for g in groups]),
            torch.cat([g.scale for g in groups]),
            torch.cat([g.offset for g in groups]),
            groups[0].group_size,
        )

    def select_rows(self, index: torch.Tensor) -> Int4Groups:
        return Int4Groups(self.q[index], self.scale[index], self.offset[index], self.group_size)


@dataclass(frozen=True)
class Int8Groups:
    """A weight as signed integer groups with one scale each: w[r, c] = q[r, c] * scale[r, c // group_size].
    Q8_0 is this with groups of 32 (the stored float16 scales, widened); Q6_K with groups of 16 (q - 32
    in [-32, 31], scale = the super-block's d times the sub-block's int8 scale: a product exact in
    float32). The native int8 kernel (FastLMHead, FastLinear's decode rows) multiplies by these directly."""

    q: torch.Tensor  # (rows, cols) int8
    scale: torch.Tensor  # (rows, cols // group_size) float32
    group_size: int = 32

    def dequantize(self) -> torch.Tensor:
        """(rows, cols) float32: the weight these groups stand for (bit-exact with ggml's dequantize)."""
        rows, cols = self.q.shape
        w = self.q.view(rows, -1, self.group_size).float()
        return w.mul_(self.scale.unsqueeze(-1)).view(rows, cols)


StoredGroups = Int4Groups | Int8Groups  # a checkpoint's own quantized groups, kept for the fast kernels


def _groups_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16).flatten(1), d, d * -8


def _groups_q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dm = _f16(b, 0, 2)
    return _nibbles(b[:, 4:], 16).flatten(1), dm[:, :1], dm[:, 1:]


def _groups_q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, offset = _k4_scales(b)  # (n, 8, 1): one per 32-element sub-block
    return _nibbles(b[:, 16:], 32).reshape(-1, 32), scale.reshape(-1, 1), -offset.reshape(-1, 1)


_INT4_GROUPS: dict[T, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    T.Q4_0: _groups_q4_0, T.Q4_1: _groups_q4_1, T.Q4_K: _groups_q4_k,
}  # fmt: skip


def int4_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int4Groups | None:
    """Raw data of a 2-D 4-bit tensor -> its Int4Groups (no expansion), or None for other types."""
    if ggml_type not in _INT4_GROUPS or len(shape) != 2:
        return None
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    q, scale, offset = _INT4_GROUPS[ggml_type](raw.view(-1, type_size))  # per group of 32
    rows, cols = shape
    return Int4Groups(q.reshape(rows, cols), scale.reshape(rows, -1), offset.reshape(rows, -1))


def int8_groups(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...]) -> Int8Groups | None:
    """Raw data of a 2-D Q8_0 or Q6_K tensor -> its Int8Groups (one copy of the int8 values), or None
    for other types."""
    if ggml_type not in (T.Q8_0, T.Q6_K) or len(shape) != 2:
        return None
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    blocks = raw.view(-1, type_size)
    rows, cols = shape
    if ggml_type == T.Q6_K:
        q, scale = _int8_q6_k(blocks)
        return Int8Groups(q.view(rows, cols), scale.view(rows, cols // 16), group_size=16)
    q = blocks[:, 2:].contiguous().view(torch.int8).view(rows, cols)  # after 2 bytes of float16 scale
    return Int8Groups(q, _f16(blocks, 0).view(rows, cols // 32))


def _int8_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks -> (q (n, 256) int8 in [-32, 31], scale (n, 16) float32), w = q * scale per 16.
    Each 128-element half h uses ql[64h:64h+64] and qh[32h:32h+32]; element 32k + l of the half
    takes nibble (k >= 2) of ql[l + 32 (k % 2)] and 2-bit pair k of qh[l]."""
    low4 = _nibbles(b[:, :128].reshape(-1, 64), 32).transpose(1, 2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high2 = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = (low4 | (high2 << 4)).view(-1, 256).view(torch.int8) - 32
    return q, _f16(b, 208) * b[:, 192:208].view(torch.int8).float()


def dequantize(raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Raw uint8 tensor data of one tensor -> a new tensor of `shape` (torch order) in `dtype`."""
    if ggml_type in _FLOAT_TYPES:  # no float32 detour: bf16 -> bf16 is a plain copy
        return raw.view(_FLOAT_TYPES[ggml_type]).reshape(shape).to(dtype, copy=True)
    _, type_size = GGML_BLOCK_SIZES[ggml_type]
    values = _BLOCK_DEQUANT[ggml_type](raw.view(-1, type_size))  # (num_blocks, block_size)
    return values.reshape(shape).to(dtype)
