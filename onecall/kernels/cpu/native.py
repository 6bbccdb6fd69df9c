"""The native CPU kernels (csrc/*.c, one library) on tensors; native_build.py builds and loads it.

Why native code at all: on an AVX2 CPU, torch's own int4 kernel expands 4-bit weights to floats
and runs float FMAs; it is compute-bound well below the memory bandwidth (measured in the README's
kernel table). The kernels in csrc/ multiply the GGUF's own 4-bit, 5-bit and int8 groups by
int16-quantized activations with exact integer dot products (IQ4 files' 4-bit codebook indices too, each
turned into its int8 codebook value by one vpshufb) (llama.cpp's idea, at a finer activation
step; int8 steps with int8_activations), its F16 / BF16 weights as they are (float32 accumulation), and
read the paged KV cache in place for decode attention and for causal prefill attention (a flash-style
tiled kernel, prefill_attention.c). Each stored form has its layout here (Q4Packed, Q5Packed,
Q8Blocked, IQ4Packed, KQPacked, HalfPacked: `Packed`), a pack_* function and its GEMM; `matmul` and `rows` pick by layout.

Every function here takes the library (`load()`: None where it cannot run, with the reason in
`unavailable_reason()`) and contiguous CPU tensors, and checks the shapes it relies on. The library's
functions and the structs it reads are declared once, in csrc/kernels.h (native_abi.py binds them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from onecall.formats.quants import CODEBOOKS

# the library's entry points and the ctypes mirrors of kernels.h's structs, re-exported: callers take
# them from here
from onecall.kernels.cpu.native_abi import DecodeLayer as DecodeLayer
from onecall.kernels.cpu.native_abi import KernelLibrary as KernelLibrary
from onecall.kernels.cpu.native_abi import Q4Weight as Q4Weight
from onecall.kernels.cpu.native_build import cpu_flags as cpu_flags
from onecall.kernels.cpu.native_build import load as load
from onecall.kernels.cpu.native_build import unavailable_reason as unavailable_reason

# K/V cache dtypes the native decode attention and cache writes read and write directly.
KV_DTYPES = (torch.float32, torch.float16)
ATTENTION_MAX_HEADS = 128  # query heads decode attention takes (csrc/decode_attention.c: ATTN_MAX_HEADS)
DELTA_MAX_DIM = 512  # largest key / value head size of the DeltaNet decode rows (csrc/delta_rule.c)


# ---- the kernels, on tensors ------------------------------------------------------------------
@dataclass(frozen=True)
class Q4Packed:
    """A 4-bit weight (N, K) in the q4 kernel's layout (csrc: rows in units of 16, two blocks of 8, N
    padded to whole units): qs (N16 / 16, K / 32, 2, 8, 8, 2) uint8, scale and offset (N16 / 16, K / 32,
    2, 8) float32 or float16, or (pack_q4_super) scale (N16 / 16, K / 256, 384) uint8, super-block factors,
    and offset empty. With act8, qs is in the q4a8 layout, (N16 / 16, K / 32, 2, 4, 8, 4), and runs with
    int8 activations."""

    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    out_features: int  # N: rows of the weight (the padding rows are never written out)
    in_features: int  # K
    act8: bool = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.offset))


def pack_q4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, act8: bool = False) -> Q4Packed:
    """(N, K) uint8 values 0..15 with (N, K / 32) scales and offsets (float32, or float16 where they are
    exact so: fewer bytes to read) -> the q4 kernel's layout. w = q * scale + offset per group of 32.
    act8: the q4a8 layout instead, for the kernel that quantizes activations to int8 (csrc)."""
    n, k = q.shape
    assert k % 32 == 0 and tuple(scale.shape) == tuple(offset.shape) == (n, k // 32)
    assert scale.dtype == offset.dtype and scale.dtype in (torch.float32, torch.float16)
    n16, g = -(-n // 16) * 16, k // 32
    pad = n16 - n
    q = q.to(torch.uint8)
    if pad:
        q = torch.cat((q, q.new_zeros(pad, k)))
        scale = torch.cat((scale, scale.new_zeros(pad, g)))
        offset = torch.cat((offset, offset.new_zeros(pad, g)))
    pairs = _nibble_pairs(q, n16, g)
    if act8:  # four bytes (columns 4j..4j+3) move together as one int32:
        # (unit, block, row, G, quarter) -> (unit, G, block, quarter, row)
        quads = pairs.view(torch.int32).view(n16 // 16, 2, 8, g, 4).permute(0, 3, 1, 4, 2).contiguous()
        qs = quads.view(torch.uint8).view(n16 // 16, g, 2, 4, 8, 4)
        return Q4Packed(qs, _blocked(scale, n16, g), _blocked(offset, n16, g), n, k, act8=True)
    return Q4Packed(_q4_layout(pairs, n16, g), _blocked(scale, n16, g), _blocked(offset, n16, g), n, k)


# act_quant.h's Q4_SUPER form: a super-block of this many groups shares a d (and an nmin) per row
Q4_SUPER_GROUPS = 8
Q4_SUPER_BYTES = 384  # per unit and super-block: float32 d[16], nmin[16], then 8 x (uint8 sc[16], mn[16])


def _super_factors(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(R, 8) float32 -> (d (R,) float32, f (R, 8) uint8) with float32(d * f) == v everywhere (a zero's sign
    aside), or None where some row has no such factors. Q4_K's scales are d * sc and its offsets -dmin * m
    with 6-bit sc, m whose largest is 63 (llama.cpp's quantizer maps a super-block's largest to 63): d =
    the entry of largest magnitude / 63 is tried on every row at once, then / 1 .. 255 on the rows left.
    Any guess is checked: f is rounded and clamped to 0..255, and a row stands only if d * f gives v back."""
    big = v.gather(1, v.abs().argmax(1, keepdim=True)).squeeze(1)  # (R,) the entry of largest magnitude
    d = torch.where(big == 0, 1.0, big / 63)  # an all-zero row: d 1, f 0
    q = torch.div(v, d[:, None]).round_().clamp_(0, 255)
    todo = ~torch.eq(q * d[:, None], v).all(1)
    for k in range(1, 256):
        if not bool(todo.any()):
            return d, q.to(torch.uint8)
        rows = todo.nonzero().squeeze(1)
        cand = big[rows] / k
        qk = torch.div(v[rows], cand[:, None]).round_().clamp_(0, 255)
        good = torch.eq(qk * cand[:, None], v[rows]).all(1)
        d[rows[good]], q[rows[good]] = cand[good], qk[good]
        todo[rows[good]] = False
    return None if bool(todo.any()) else (d, q.to(torch.uint8))


def pack_q4_super(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q4Packed | None:
    """pack_q4 with the scales and offsets kept as super-block factors (act_quant.h's Q4_SUPER: Q4_K's own
    form, 2.5 bytes a row and group where float32 takes 8; the kernels compute the same float32 values), or
    None where they do not factor exactly (not Q4_K's: pack_q4 then) or K is not a multiple of 256."""
    n, k = q.shape
    assert tuple(scale.shape) == tuple(offset.shape) == (n, k // 32)
    assert scale.dtype == offset.dtype == torch.float32
    g = k // 32
    if k % 32 or g % Q4_SUPER_GROUPS:
        return None
    n16, s = -(-n // 16) * 16, g // Q4_SUPER_GROUPS
    pad = n16 - n
    if pad:
        scale = torch.cat((scale, scale.new_zeros(pad, g)))
        offset = torch.cat((offset, offset.new_zeros(pad, g)))
    sd = _super_factors(scale.reshape(-1, Q4_SUPER_GROUPS))
    od = _super_factors(offset.reshape(-1, Q4_SUPER_GROUPS))
    if sd is None or od is None:
        return None
    units = n16 // 16

    def lanes(t: torch.Tensor) -> torch.Tensor:  # (N16, S, ...) -> (units, S, ..., 16): lane l row 16u + l
        t = t.reshape(units, 16, s, -1)
        return t.permute(0, 2, 3, 1).contiguous()

    d, nmin = lanes(sd[0].view(n16, s)), lanes(od[0].view(n16, s))  # (units, S, 1, 16) float32
    # (units, S, 8, 2, 16): per group, the 16 rows' sub-scales, then their mins
    f = torch.stack((lanes(sd[1].view(n16, s, 8)), lanes(od[1].view(n16, s, 8))), dim=3)
    table = torch.cat(
        (d.view(torch.uint8).reshape(units, s, 64), nmin.view(torch.uint8).reshape(units, s, 64),
         f.reshape(units, s, 256)), dim=2,
    )  # fmt: skip
    q = q.to(torch.uint8)
    if pad:
        q = torch.cat((q, q.new_zeros(pad, k)))
    qs = _q4_layout(_nibble_pairs(q, n16, g), n16, g)  # pack_q4's nibbles, without its float scales
    return Q4Packed(qs, table, table.new_empty(0), n, k)


def q4_scales_mode(w: Q4Packed) -> int:
    """The q4 kernels' scales argument for w: 0 float32, 1 IEEE half, 2 super-block factors (Q4_SUPER)."""
    return 2 if w.scale.dtype == torch.uint8 else int(w.scale.dtype == torch.float16)


def _nibble_pairs(q: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """(N16, K) uint8 values 0..15 -> (N16, G, 16) bytes: byte j of a row's group holds column j in its low
    nibble and column 16 + j in its high one (one pass)."""
    halves = q.view(n16, g, 2, 16)
    pairs = torch.empty(n16, g, 16, dtype=torch.uint8)
    torch.add(halves[:, :, 0], halves[:, :, 1], alpha=16, out=pairs)
    return pairs


def _q4_layout(pairs: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """_nibble_pairs' bytes -> the q4 layout (N16 / 16, G, 2, 8, 8, 2): the two bytes of a column pair move
    together as one int16, (unit, block, row, G, pair) -> (unit, G, block, pair, row)."""
    qs = pairs.view(torch.int16).view(n16 // 16, 2, 8, g, 8).permute(0, 3, 1, 4, 2).contiguous()
    return qs.view(torch.uint8).view(n16 // 16, g, 2, 8, 8, 2)


def _blocked(t: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """(N16, G) per-row group values -> (N16 / 16, G, 2, 8): a unit's two blocks' rows of one group side
    by side."""
    return t.view(n16 // 16, 2, 8, g).permute(0, 3, 1, 2).contiguous()


def _gemm(
    kernel: Callable[..., int],
    x: torch.Tensor,
    w: Packed,
    weight: tuple[int, ...],
    bias: torch.Tensor | None,
    num_threads: int,
    tail: tuple[int, ...],
    refused: str,
) -> torch.Tensor:
    """The call every quantized GEMM shares: x (M, K) float32 contiguous -> y (M, N) = x @ W^T (+ bias),
    kernel(x, M, K, *weight, N, bias, y, num_threads, *tail) (kernels.h's order); -1 is out of memory for
    the activation buffer, any other non-zero what the kernel `refused`."""
    m, k = x.shape
    assert k == w.in_features and x.dtype == torch.float32 and x.is_contiguous()
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    rc = kernel(x.data_ptr(), m, k, *weight, w.out_features, None if bias is None else bias.data_ptr(),
                y.data_ptr(), num_threads, *tail)  # fmt: skip
    if rc == -1:
        raise MemoryError(f"{getattr(kernel, '__name__', kernel)}: out of memory for the activation buffer")
    assert rc == 0, f"{getattr(kernel, '__name__', kernel)} refused {refused} (rc {rc})"
    return y


def q4_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: Q4Packed, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_q4."""
    kernel = lib.onecall_q4a8_gemm if w.act8 else lib.onecall_q4_gemm
    weight = (w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr())
    # -2: super-block factors with K % 256 != 0 (pack_q4_super never makes them)
    return _gemm(kernel, x, w, weight, bias, num_threads, (q4_scales_mode(w),), "the scales' mode")


@dataclass(frozen=True)
class Q5Packed:
    """A 5-bit weight (N, K) in the q5 kernel's layout (csrc/gemm_q5.c: rows in units of 16, N padded to
    whole units): qs (N16 / 16, K / 32, 320) uint8, each unit's group the q4 layout's 256 bytes of low
    nibbles then 16 uint32 words of 5th bits; scale and offset (N16 / 16, K / 32, 2, 8) float32 or
    float16."""

    qs: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scale, self.offset))


def pack_q5(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Q5Packed:
    """(N, K) uint8 values 0..31 with (N, K / 32) scales and offsets (float32, or float16 where exact) ->
    the q5 kernel's layout. w = q * scale + offset per group of 32."""
    n, k = q.shape
    low = pack_q4(q & 15, scale, offset)  # the nibbles, scales and offsets exactly as q4 lays them out
    n16, g = low.qs.shape[0] * 16, k // 32
    high = (q >> 4).to(torch.uint8)
    if n16 > n:
        high = torch.cat((high, high.new_zeros(n16 - n, k)))
    # bit b + 8h + 16j of word (unit, group, block k, pair c) is the 5th bit of row 16 unit + 8k + b,
    # column 32 group + 16h + 2c + j: (unit, k, b, G, h, c, j) -> (unit, G, k, c, j, h, b), then each
    # run of 8 bits (b) is one byte of the little-endian word
    bits = high.view(n16 // 16, 2, 8, g, 2, 8, 2).permute(0, 3, 1, 5, 6, 4, 2).reshape(-1, 8)
    words = (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    qs = torch.cat((low.qs.view(n16 // 16, g, 256), words.view(n16 // 16, g, 64)), dim=-1)
    return Q5Packed(qs.contiguous(), low.scale, low.offset, n, k)


def q5_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: Q5Packed, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_q5; activations
    rounded to int16 steps per group of 32, as the q4 kernel does."""
    weight = (w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr())
    f16 = int(w.scale.dtype == torch.float16)
    return _gemm(lib.onecall_q5_gemm, x, w, weight, bias, num_threads, (f16,), f"K {w.in_features}")


def q5_rows(lib: ctypes.CDLL, w: Q5Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_q5, dequantized: (*ids.shape, K)
    float32, each value float(q) * scale + offset (an embedding lookup on 5-bit groups)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    rc = lib.onecall_q5_rows(
        w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), w.out_features, w.in_features,
        int(w.scale.dtype == torch.float16), flat.data_ptr(), flat.shape[0], out.data_ptr(),
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    assert rc == 0, f"onecall_q5_rows refused K {w.in_features} (rc {rc})"
    return out.view(*ids.shape, w.in_features)


@dataclass(frozen=True)
class KQPacked:
    """A Q6_K, Q3_K or Q2_K weight (N, K) in the kq layout (csrc/gemm_kq.c: rows in units of 16, N padded
    to whole units): qs (N16 / 16, K / 32, 384 | 192 | 128) uint8, each unit's group its codes' bit planes
    (bits 6: q4's nibbles then a 2-bit plane; 3: a 2-bit plane then q5's words of single bits; 2: a
    2-bit plane); scales (planes, N16 / 16, K / 32, 2, 2, 8) int8, the sub-scales per 16 columns (Q2_K:
    then the mins); supers (planes, N16 / 16, K / 256, 2, 8) float16, d (Q2_K: then dmin)."""

    qs: torch.Tensor
    scales: torch.Tensor
    supers: torch.Tensor
    out_features: int
    in_features: int
    bits: int  # 6 (Q6_K), 3 (Q3_K), 2 (Q2_K)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.supers))


def _two_bit_plane(p: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """(N16, K) values 0..3 -> the kq layout's 2-bit plane (N16 / 16, G, 128): byte 2b + j of chunk c holds
    (block k, half h)'s row b, column 16h + 2c + j at bits 4k + 2h: (unit, k, b, G, h, c, j) -> (unit, G,
    c, b, j, k h), the four pairs shifted into one byte."""
    pairs = p.view(n16 // 16, 2, 8, g, 2, 8, 2).permute(0, 3, 5, 1, 4, 2, 6).reshape(n16 // 16, g, 8, 4, 8, 2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1, 1)
    return (pairs << shifts).sum(3, dtype=torch.uint8).reshape(n16 // 16, g, 128)


def _bit_words(bits: torch.Tensor, n16: int, g: int) -> torch.Tensor:
    """(N16, K) bits -> pack_q5's words of 5th bits (N16 / 16, G, 64): bit b + 8h + 16j of word (block k,
    pair c) is row 8k + b's column 16h + 2c + j."""
    runs = bits.view(n16 // 16, 2, 8, g, 2, 8, 2).permute(0, 3, 1, 5, 6, 4, 2).reshape(-1, 8)
    return (runs << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8).view(n16 // 16, g, 64)


def pack_kq(
    bits: int, q: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor,
    sub_min: torch.Tensor | None = None, dmin: torch.Tensor | None = None,
) -> KQPacked:  # fmt: skip
    """(N, K) uint8 codes of `bits` 6, 3 or 2 (quants.KQuantGroups' fields) with (N, K / 16) int8
    sub-scales and (N, K / 256) super-block d (float16 values; Q2_K: the mins and dmin too) -> the kq
    layout."""
    n, k = q.shape
    assert bits in (6, 3, 2) and k % 256 == 0 and (sub_min is not None) == (dmin is not None) == (bits == 2)
    n16, g, s = -(-n // 16) * 16, k // 32, k // 256

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t.new_zeros(n16 - n, t.shape[1]))) if n16 > n else t.contiguous()

    q = q.to(torch.uint8).contiguous()
    lib = load()
    if lib is not None:  # one pass in C (a tied Q6_K head is 10^8 codes), the same bytes as below
        qs = torch.empty(n16 // 16, g, {6: 384, 3: 192, 2: 128}[bits], dtype=torch.uint8)
        rc = lib.onecall_kq_pack(q.data_ptr(), n, k, bits, qs.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"onecall_kq_pack refused K {k} or bits {bits} (rc {rc})"
    elif bits == 6:
        q = padded(q)
        low = _q4_layout(_nibble_pairs(q & 15, n16, g), n16, g).view(n16 // 16, g, 256)
        qs = torch.cat((low, _two_bit_plane(q >> 4, n16, g)), dim=-1)
    elif bits == 3:
        q = padded(q)
        qs = torch.cat((_two_bit_plane(q & 3, n16, g), _bit_words(q >> 2, n16, g)), dim=-1)
    else:
        qs = _two_bit_plane(padded(q), n16, g)
    scales = [sub_scale] if sub_min is None else [sub_scale, sub_min]
    supers = [d] if dmin is None else [d, dmin]
    assert all(t.dtype == torch.int8 and tuple(t.shape) == (n, k // 16) for t in scales)
    assert all(tuple(t.shape) == (n, s) and torch.equal(t.half().float(), t.float()) for t in supers)
    scale_planes = torch.stack(
        [padded(t).view(n16 // 16, 2, 8, g, 2).permute(0, 3, 1, 4, 2) for t in scales]
    ).contiguous()  # (planes, unit, G, k, h, b)
    super_planes = torch.stack([_blocked(padded(t.half()), n16, s) for t in supers]).contiguous()
    return KQPacked(qs.contiguous(), scale_planes, super_planes, n, k, bits)


def kq_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: KQPacked, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_kq; activations
    rounded to int16 steps per group of 32, as the q4 kernel does."""
    weight = (w.qs.data_ptr(), w.scales.data_ptr(), w.supers.data_ptr())
    refused = f"K {w.in_features} or bits {w.bits}"
    return _gemm(lib.onecall_kq_gemm, x, w, weight, bias, num_threads, (w.bits,), refused)


def kq_rows(lib: ctypes.CDLL, w: KQPacked, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_kq, dequantized: (*ids.shape, K)
    float32, each value exactly KQuantGroups.dequantize's (an embedding lookup, a tied head's table)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    rc = lib.onecall_kq_rows(
        w.qs.data_ptr(), w.scales.data_ptr(), w.supers.data_ptr(), w.out_features, w.in_features, w.bits,
        flat.data_ptr(), flat.shape[0], out.data_ptr(),
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    assert rc == 0, f"onecall_kq_rows refused K {w.in_features} or bits {w.bits} (rc {rc})"
    return out.view(*ids.shape, w.in_features)


@dataclass(frozen=True)
class HalfPacked:
    """A weight (N, K) of 16-bit floats in the h16 layout (csrc/gemm_half.c: rows in units of 16, N padded
    to whole units): values (N16 / 16, K, 16) float16 or bfloat16, column by column within a unit."""

    values: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.values.numel() * 2


def pack_half(w: torch.Tensor) -> HalfPacked:
    """(N, K) float16 or bfloat16 -> the h16 layout (a copy of the same values, reordered)."""
    n, k = w.shape
    assert w.dtype in (torch.float16, torch.bfloat16)
    n16 = -(-n // 16) * 16
    if n16 > n:
        w = torch.cat((w, w.new_zeros(n16 - n, k)))
    return HalfPacked(w.view(n16 // 16, 16, k).transpose(1, 2).contiguous(), n, k)


def half_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: HalfPacked, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_half: each
    weight widened to float32 exactly, float32 accumulation in order along K."""
    tail = (int(w.values.dtype == torch.bfloat16),)
    return _gemm(lib.onecall_half_gemm, x, w, (w.values.data_ptr(),), bias, num_threads, tail, "its shapes")


def half_rows(w: HalfPacked, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_half, widened to float32 (exact):
    (*ids.shape, K). An id outside the table is an IndexError."""
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.out_features):
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    rows = w.values[flat // 16, :, flat % 16]  # (M, K)
    return rows.float().view(*ids.shape, w.in_features)


@dataclass(frozen=True)
class Q8Blocked:
    """An int8 weight (N, K) in the q8b layout (csrc: rows in units of 16, N padded to whole units):
    qs (N16 / 16, K / 32, 2, 16, 8, 2) int8, scale (N16 / 16, K / group_size, 2, 8) float32."""

    qs: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int
    group_size: int  # 32 (Q8_0) or 16 (Q6_K)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.scale.numel() * 4


def pack_q8_blocked(q: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> Q8Blocked:
    """(N, K) int8 with (N, K / group_size) scales -> the q8b layout. w = q * scale per group."""
    n, k = q.shape
    assert k % 32 == 0 and group_size in (16, 32) and tuple(scale.shape) == (n, k // group_size)
    n16, g, gs = -(-n // 16) * 16, k // 32, k // group_size
    q, scale = q.to(torch.int8), scale.float()
    if n16 > n:
        q = torch.cat((q, q.new_zeros(n16 - n, k)))
        scale = torch.cat((scale, scale.new_zeros(n16 - n, gs)))
    # a column pair's two bytes move together as one int16: (unit, block, row, G, pair) ->
    # (unit, G, block, pair, row)
    pairs = q.contiguous().view(torch.int16).view(n16 // 16, 2, 8, g, 16).permute(0, 3, 1, 4, 2).contiguous()
    qs = pairs.view(torch.int8).view(n16 // 16, g, 2, 16, 8, 2)
    return Q8Blocked(qs, _blocked(scale, n16, gs), n, k, group_size)


def q4_rows(lib: ctypes.CDLL, w: Q4Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_q4 (not act8), dequantized:
    (*ids.shape, K) float32, each value float(q) * scale + offset (an embedding lookup on 4-bit groups)."""
    assert not w.act8, "rows are read from the q4 layout"
    assert w.scale.dtype != torch.uint8, "rows are read with float scales (pack_q4), not super-block factors"
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    rc = lib.onecall_q4_rows(
        w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), w.out_features, w.in_features,
        int(w.scale.dtype == torch.float16), flat.data_ptr(), flat.shape[0], out.data_ptr(),
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    assert rc == 0, f"onecall_q4_rows refused K {w.in_features} (rc {rc})"
    return out.view(*ids.shape, w.in_features)


def q8_blocked_rows(lib: ctypes.CDLL, w: Q8Blocked, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_q8_blocked, dequantized:
    (*ids.shape, K) float32, each value float(q) * scale (an embedding lookup on int8 groups)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    rc = lib.onecall_q8b_rows(
        w.qs.data_ptr(), w.scale.data_ptr(), w.out_features, w.in_features, w.group_size,
        flat.data_ptr(), flat.shape[0], out.data_ptr(),
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    assert rc == 0, f"onecall_q8b_rows refused group size {w.group_size} or K {w.in_features} (rc {rc})"
    return out.view(*ids.shape, w.in_features)


def q8_blocked_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: Q8Blocked, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_q8_blocked;
    activations rounded to int16 steps per group of 32, as the q4 kernel does."""
    refused = f"group size {w.group_size} or K {w.in_features}"
    weight = (w.qs.data_ptr(), w.scale.data_ptr())
    return _gemm(lib.onecall_q8b_gemm, x, w, weight, bias, num_threads, (w.group_size,), refused)


@dataclass(frozen=True)
class IQ4Packed:
    """A weight (N, K) of 4-bit indices into a 16-value codebook, one scale per group of 32 (IQ4_NL, IQ4_XS:
    kvalues_iq4nl, "iq4nl"; MXFP4: e2m1 doubled, "mxfp4": quants.CODEBOOKS) in the iq4 layout
    (csrc/gemm.c): qs the codes in the q4 layout's bytes, (N16 / 16, K / 32, 2, 8, 8, 2) uint8, scale (N16 /
    16, K / 32, 2, 8) float32 or float16 (where exact). w = codebook[code] * scale."""

    qs: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int
    codebook: str = "iq4nl"  # a key of quants.CODEBOOKS: which table the kernel looks the codes up in

    @property
    def codebook_id(self) -> int:
        """The kernels' number for the codebook (csrc/codebooks.h: CODEBOOKS' order)."""
        return list(CODEBOOKS).index(self.codebook)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.scale.numel() * self.scale.element_size()


def pack_iq4(codes: torch.Tensor, scale: torch.Tensor, codebook: str = "iq4nl") -> IQ4Packed:
    """(N, K) uint8 codes 0..15 into quants.CODEBOOKS[codebook] with (N, K / 32) float32 scales -> the iq4
    layout; the scales kept as float16 when every one is exactly a float16 (IQ4_NL's d always is, MXFP4's
    2^(e - 128) for e in 104..143), else float32."""
    n, k = codes.shape
    assert k % 32 == 0 and tuple(scale.shape) == (n, k // 32) and codebook in CODEBOOKS
    n16, g = -(-n // 16) * 16, k // 32
    codes, scale = codes.to(torch.uint8), scale.float()
    if n16 > n:
        codes = torch.cat((codes, codes.new_zeros(n16 - n, k)))
        scale = torch.cat((scale, scale.new_zeros(n16 - n, g)))
    half = scale.half()
    if torch.equal(half.float(), scale):
        scale = half
    return IQ4Packed(
        _q4_layout(_nibble_pairs(codes, n16, g), n16, g), _blocked(scale, n16, g), n, k, codebook
    )


def iq4_gemm(
    lib: ctypes.CDLL, x: torch.Tensor, w: IQ4Packed, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), W packed by pack_iq4; activations
    rounded to int16 steps per group of 32, as the q4 kernel does."""
    tail = (int(w.scale.dtype == torch.float16), w.codebook_id)
    weight = (w.qs.data_ptr(), w.scale.data_ptr())
    refused = f"K {w.in_features} or its codebook"
    return _gemm(lib.onecall_iq4_gemm, x, w, weight, bias, num_threads, tail, refused)


def iq4_rows(lib: ctypes.CDLL, w: IQ4Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64) of the (N, K) table packed by pack_iq4, dequantized: (*ids.shape, K)
    float32, each value float(codebook[code]) * scale."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    rc = lib.onecall_iq4_rows(
        w.qs.data_ptr(), w.scale.data_ptr(), w.out_features, w.in_features, int(w.scale.dtype == torch.float16),
        flat.data_ptr(), flat.shape[0], out.data_ptr(), w.codebook_id,
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"a token id outside the embedding's {w.out_features} rows")
    assert rc == 0, f"onecall_iq4_rows refused K {w.in_features} (rc {rc})"
    return out.view(*ids.shape, w.in_features)


# A weight in the layout its native GEMM reads (packed from the checkpoint's own stored form)
Packed = Q4Packed | Q5Packed | Q8Blocked | IQ4Packed | KQPacked | HalfPacked


def matmul(
    lib: ctypes.CDLL, x: torch.Tensor, w: Packed, bias: torch.Tensor | None, num_threads: int
) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N) float32 = x @ W^T (+ bias), on W's own kernel."""
    if isinstance(w, Q4Packed):
        return q4_gemm(lib, x, w, bias, num_threads)
    if isinstance(w, Q5Packed):
        return q5_gemm(lib, x, w, bias, num_threads)
    if isinstance(w, Q8Blocked):
        return q8_blocked_gemm(lib, x, w, bias, num_threads)
    if isinstance(w, IQ4Packed):
        return iq4_gemm(lib, x, w, bias, num_threads)
    if isinstance(w, KQPacked):
        return kq_gemm(lib, x, w, bias, num_threads)
    return half_gemm(lib, x, w, bias, num_threads)


def kind(w: Packed) -> str:
    """What a packed weight holds, for logs and DecoderLM.kernels: int4, int5, int8, iq4, mxfp4, q6k, q3k,
    q2k, f16 or bf16."""
    if isinstance(w, HalfPacked):
        return "bf16" if w.values.dtype == torch.bfloat16 else "f16"
    if isinstance(w, IQ4Packed) and w.codebook == "mxfp4":
        return "mxfp4"
    if isinstance(w, KQPacked):
        return {6: "q6k", 3: "q3k", 2: "q2k"}[w.bits]
    return {Q4Packed: "int4", Q5Packed: "int5", Q8Blocked: "int8", IQ4Packed: "iq4"}[type(w)]


def rows(lib: ctypes.CDLL, w: Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of a packed (N, K) table as float32, (*ids.shape, K): each value exactly the
    file's dequantized one (an embedding lookup). IndexError for an id outside the table."""
    if isinstance(w, Q4Packed):
        return q4_rows(lib, w, ids)
    if isinstance(w, Q5Packed):
        return q5_rows(lib, w, ids)
    if isinstance(w, Q8Blocked):
        return q8_blocked_rows(lib, w, ids)
    if isinstance(w, IQ4Packed):
        return iq4_rows(lib, w, ids)
    if isinstance(w, KQPacked):
        return kq_rows(lib, w, ids)
    return half_rows(w, ids)


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    num_threads: int,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged KV, read in place (see csrc).

    q (S, H, D) float32 with contiguous heads (rows may be strided: a slice of the fused qkv output);
    k_cache, v_cache (num_slots, KVH, D) float32 or float16, contiguous; block_tables (S, max_blocks) int32;
    seq_lens (S,) int32. Returns (S, H, D) float32. sliding_window: each query sees only its last
    that many positions; logit_softcap: scores -> softcap * tanh(scores / softcap); sinks (H,): attention
    sinks, one logit per query head in each softmax's denominator (model/attention.py; cast to a
    contiguous float32 copy if it is not one).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    kv_f16 = int(k_cache.dtype == torch.float16)
    if sinks is None:
        rc = lib.onecall_paged_decode_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            block_size, scale, sliding_window or 0, logit_softcap or 0.0, out.data_ptr(), num_threads, kv_f16,
        )  # fmt: skip
    else:
        sinks = _sinks(sinks, num_heads)
        rc = lib.onecall_paged_decode_attention_sinks(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            block_size, scale, sliding_window or 0, logit_softcap or 0.0, sinks.data_ptr(), out.data_ptr(),
            num_threads, kv_f16,
        )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_paged_decode_attention: out of memory for partial results")
    assert rc == 0, f"onecall_paged_decode_attention refused the shapes (rc {rc})"
    return out


def _sinks(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Attention sinks as the kernels read them: (num_heads,) float32, contiguous, on the CPU."""
    assert sinks.shape == (num_heads,), f"one sink per query head: {tuple(sinks.shape)} for {num_heads} heads"
    return sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What both attention kernels need: float32 queries (.., H, D), a float32 or float16 cache
    (slots, KVH, D), whole query heads per KV head."""
    return q.dtype == torch.float32 and k_cache.dtype in KV_DTYPES and q.shape[1] % k_cache.shape[1] == 0


def decode_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes paged_decode_attention takes: _attention_fits, head_dim a multiple of 8, at
    most 128 query heads."""
    return _attention_fits(q, k_cache) and q.shape[2] % 8 == 0 and q.shape[1] <= ATTENTION_MAX_HEADS


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: int,
    kv_start: int,
    blocks: torch.Tensor | None,
    block_size: int,
    scale: float,
    num_threads: int,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's causal attention for its query_len new rows over its seq_len positions, the KV
    read in place (csrc/prefill_attention.c). Row i is at position seq_len - query_len + i and sees
    keys 0 .. its position (its last `sliding_window` of them with a window); `sinks` as
    paged_decode_attention's.

    q (query_len, H, D) float32 with contiguous heads (rows may be strided); k_cache, v_cache
    (num_slots, KVH, D) float32 or float16, contiguous; the KV at slots kv_start + p (kv_start >= 0),
    else through `blocks` (num_blocks,) int64. Returns (query_len, H, D) float32. Shapes must pass
    prefill_attention_fits."""
    query_len, num_heads, head_dim = q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert (kv_start >= 0) != (blocks is not None), "the KV is one run (kv_start) or blocks, not both"
    assert blocks is None or (blocks.dtype == torch.int64 and blocks.is_contiguous())
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = torch.empty(query_len, num_heads, head_dim, dtype=torch.float32)
    sinks = None if sinks is None else _sinks(sinks, num_heads)
    rc = lib.onecall_prefill_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        None if blocks is None else blocks.data_ptr(), kv_start, block_size, query_len, seq_len,
        num_heads, k_cache.shape[1], head_dim, scale, sliding_window or 0, logit_softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), out.data_ptr(), num_threads,
        int(k_cache.dtype == torch.float16),
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_prefill_attention: out of memory for its tile buffers")
    assert rc == 0, f"onecall_prefill_attention refused the shapes (rc {rc})"
    return out


def prefill_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes prefill_attention takes: _attention_fits, head_dim a multiple of 16 up to 512."""
    return _attention_fits(q, k_cache) and q.shape[2] % 16 == 0 and q.shape[2] <= 512


def add_rms_norm(
    lib: ctypes.CDLL, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += residual (in place, when given), then returns RMSNorm(h) * weight. h, residual (M, K)
    float32 contiguous, weight (K,) float32."""
    m, k = h.shape
    assert h.is_contiguous() and (residual is None or residual.is_contiguous())
    y = torch.empty_like(h)
    lib.onecall_add_rms_norm(
        h.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        m,
        k,
        eps,
        y.data_ptr(),
    )
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a (M, N) tensor, bit for bit (the first maximum; a row's first NaN if it
    holds one): in C (csrc/argmax.c) for float32 rows on the CPU when the kernels are built, else
    torch's own. The sampler's greedy pick (engine.py passes it in)."""
    lib = load()
    if lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] < 1:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = lib.onecall_argmax_rows(
        x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    assert rc == 0, f"onecall_argmax_rows refused a ({x.shape[0]}, {x.shape[1]}) tensor (rc {rc})"
    return out


def silu_mul(lib: ctypes.CDLL, y: torch.Tensor) -> torch.Tensor:
    """y (M, 2I) float32 contiguous -> silu(y[:, :I]) * y[:, I:], (M, I)."""
    m, two_i = y.shape
    assert y.is_contiguous() and two_i % 2 == 0
    out = torch.empty(m, two_i // 2, dtype=torch.float32)
    lib.onecall_silu_mul(y.data_ptr(), m, two_i // 2, out.data_ptr())
    return out


def rope_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on qkv's q and k heads in place, then its k and v heads stored at their cache slots.

    qkv (M, (H + 2 KVH) * D) float32 contiguous; cos, sin (M, D / 2) float32 contiguous; slot_mapping
    (M,) int64; k_cache, v_cache (num_slots, KVH, D) float32 contiguous. qk_norm: (q weight (D,),
    k weight (D,), eps), Qwen3's per-head RMSNorm, applied to every q / k head before it is rotated.
    """
    m = qkv.shape[0]
    head_dim = k_cache.shape[2]
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
    assert k_cache.dtype in KV_DTYPES and (k_cache.dtype == torch.float32 or num_kv_heads * head_dim % 8 == 0)
    q_norm = k_norm = None
    eps = 0.0
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        assert q_w.dtype == k_w.dtype == torch.float32 and q_w.is_contiguous() and k_w.is_contiguous()
        assert q_w.numel() == k_w.numel() == head_dim
        q_norm, k_norm = q_w.data_ptr(), k_w.data_ptr()
    lib.onecall_rope_store(
        qkv.data_ptr(), m, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.float16),
    )  # fmt: skip


def quantize_q8_groups(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) int8 in [-127, 127], scale (N, K / group_size) float32), per group
    absmax / 127. For a weight that was stored as Q8_0 this recovers the stored values (to float32
    rounding of the scale); for any other weight it is a lossy approximation."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 127.0  # (N, G)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(groups * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).view(n, k)
    return q.contiguous(), scale.contiguous()


def delta_decode_rows(
    lib: ctypes.CDLL,
    proj: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    num_k_heads: int,
    l2_eps: float,
    norm_eps: float,
    num_threads: int,
) -> torch.Tensor:
    """A Gated DeltaNet layer's one-token rows (csrc/delta_rule.c; LayerOps.delta_decode_rows's contract):
    proj (M, >= conv_dim + HV (DV + 2)) rows [q | k | v | z | b | a], unit column stride; slots (M,)
    int64; fresh (M,) bool or None; conv_state (num_slots, conv_dim, kernel - 1) and recurrent_state
    (num_slots, HV, DK, DV) float32 contiguous, updated in place; conv_weight (conv_dim, 1, kernel),
    A_log, dt_bias (HV,), norm_weight (DV,) float32. -> (M, HV * DV) float32."""
    m = proj.shape[0]
    num_slots, heads, k_dim, v_dim = recurrent_state.shape
    conv_dim, kernel = conv_weight.shape[0], conv_weight.shape[-1]
    assert conv_dim == 2 * num_k_heads * k_dim + heads * v_dim, "conv_weight does not match the heads"
    assert tuple(conv_state.shape) == (num_slots, conv_dim, kernel - 1), "conv_state does not match the conv"
    assert proj.dtype == torch.float32 and proj.stride(1) == 1, "proj must be float32 rows, unit stride"
    assert proj.shape[1] >= conv_dim + heads * (v_dim + 2), "proj rows too short for [qkv | z | b | a]"
    assert conv_state.is_contiguous() and recurrent_state.is_contiguous()
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == m
    assert fresh is None or (fresh.dtype == torch.bool and fresh.is_contiguous() and fresh.numel() == m)
    small = [t.contiguous() for t in (conv_weight, A_log, dt_bias, norm_weight)]
    assert all(t.dtype == torch.float32 for t in small)
    out = torch.empty(m, heads * v_dim, dtype=torch.float32)
    rc = lib.onecall_delta_decode_rows(
        proj.data_ptr(), proj.stride(0), m, slots.data_ptr(), None if fresh is None else fresh.data_ptr(),
        conv_state.data_ptr(), recurrent_state.data_ptr(), num_slots, small[0].data_ptr(), kernel,
        small[1].data_ptr(), small[2].data_ptr(), small[3].data_ptr(), num_k_heads, heads, k_dim, v_dim,
        l2_eps, norm_eps, out.data_ptr(), num_threads,
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("onecall_delta_decode_rows: out of memory for its scratch rows")
    if rc == -3:
        raise ValueError(
            f"onecall_delta_decode_rows: slots {slots.tolist()} outside 0..{num_slots - 1} or repeated"
        )
    assert rc == 0, f"onecall_delta_decode_rows refused its shapes (rc {rc})"
    return out
