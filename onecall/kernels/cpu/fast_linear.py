"""Fast CPU matmuls behind one switch (EngineConfig.kernels = "fast"); nn.Linear is the reference.

Decode on a CPU is bound by how fast the weights stream through the cores; torch's default
float32 GEMM (MKL) streams them slowly at decode's skinny shapes. Per projection:

* a weight the checkpoint stored in a form a native kernel multiplies by directly (quants.py's table:
  4-bit groups of 32, Q4_0/Q4_1/Q4_K; 5-bit groups of 32, Q5_0/Q5_1/Q5_K; int8 groups, Q8_0, IQ4_NL,
  IQ4_XS, MXFP4; the K-quants' 6-, 3- and 2-bit codes per 16, Q6_K/Q3_K/Q2_K; 16-bit floats, F16/BF16), or in parts of those (Q4_K_M files keep v in
  Q6_K beside q/k in Q4_K, or in Q8_0 beside Q5_0 where a width is not a multiple of 256): every row,
  decode and prompt alike, runs the native kernels on the file's own weights (kernels/cpu/native.py,
  csrc/gemm*.c: int16 activations per group of 32 and exact integer dot products for the groups, int8
  ones with int8_activations for 4-bit groups; float32 accumulation for 16-bit floats), at an eighth
  (4-bit) to a half (16-bit) of float32's bytes. At a prompt's many rows the kernels are compute-bound,
  near oneDNN's float32 GEMM (benchmarks/bench_kernels.py; docs/benchmarks.md); one kernel for every row
  makes a row's result independent of the batch by construction, and no float32 copy is ever made for
  such a weight (cold start, and memory: a Q8_0 file's float32 copy would be four times its size). A
  projection in parts runs one call per part (the one-call decode step, loading/native_step.py, runs
  the same parts as a chain).
* otherwise, prompt rows: oneDNN with the float32 weight prepacked once into its blocked layout
  (`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`). Same float32 math as the
  reference, only the summation order differs; a row's result does not depend on how many rows
  share the call (checked in tests), so chunked prefill gives the same bits as one chunk.
* decode rows of a 4-bit weight the native kernel cannot take (no compiler, groups of 64...):
  torch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations, scales and zeros); prompt rows oneDNN.

Which rows are "decode" is the step's, not the call's: each call is told how many of its first
rows are decode tokens (`forward(x, decode_rows)`: the step's AttentionMetadata.num_decode, which
the layers pass on; the rest are prompt tokens), so a request's tokens go through the same kernels
whatever else shares its batch (batch invariance; tests/engine/test_batch_invariance.py). A call
told nothing (decode_rows None: tests, the attention probe) counts as decode when it has at most
INT4_MAX_ROWS rows. The logits (FastLMHead) of a weight stored in one of those forms run on its
kernel too.

The reference path (`kernels="reference"`) is the oracle the tests compare against.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import nn

from onecall.formats.quants import (
    HalfWeights,
    Int4CodeGroups,
    Int4Groups,
    Int5Groups,
    Int8Groups,
    KQuantGroups,
    StoredGroups,
    cat_rows,
)
from onecall.kernels.cpu import native

# A call not told its decode rows counts as decode up to this many rows.
INT4_MAX_ROWS = 16
# oneDNN packs a weight for an expected batch size; any batch works with any packing, but packing for
# 16 rows ran batch-16 decode faster than packing for 1, at no cost for 1 row (docs/benchmarks.md).
_ONEDNN_PACK_ROWS = 16
_INT4_INNER_K_TILES = 2  # packing parameter of torch's CPU int4 layout
# A logits weight counts as stored in int8 groups when re-quantizing it reproduces it to this
# fraction of its largest magnitude (Q8_0 data: ~1e-7, float32 rounding of the scale; a float weight
# would be off by up to 1/254 of each group's largest value).
_Q8_EXACT_RTOL = 2.0**-20


def num_decode_rows(rows: int, decode_rows: int | None) -> int:
    """How many of a call's first `rows` rows run the decode kernel: `decode_rows` as the step planned
    it, else (None) all of them up to INT4_MAX_ROWS rows, none above."""
    if decode_rows is None:
        return rows if rows <= INT4_MAX_ROWS else 0
    assert decode_rows <= rows, f"{decode_rows} decode rows but the call has {rows} rows"
    return decode_rows


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes torch's CPU int4 kernel accepts: whole groups along K, N in blocks of 16."""
    return in_features % group_size == 0 and in_features % 2 == 0 and out_features % 16 == 0


def _native() -> ctypes.CDLL | None:
    return native.load()


# quants.StoredGroups' members
_STORED = (Int4Groups, Int5Groups, Int8Groups, Int4CodeGroups, KQuantGroups, HalfWeights)


def runs_stored_only(stored: StoredGroups | Sequence[tuple[int, int, StoredGroups]]) -> bool:
    """Whether a FastLinear over these stored groups runs every row on the native kernels (then it
    needs no float32 weight): every part one the kernels take (_native_groups) and the kernels built."""
    parts = [stored] if isinstance(stored, _STORED) else [g for _, _, g in stored]
    return bool(parts) and all(_native_groups(g) for g in parts) and _native() is not None


def _native_groups(g: StoredGroups) -> bool:
    """4-bit or 5-bit groups and IQ4 codes of 32, int8 groups of 32 or 16, along a multiple of 32; 16-bit
    floats."""
    if isinstance(g, HalfWeights):
        return g.values.dtype in (torch.float16, torch.bfloat16)
    if isinstance(g, KQuantGroups):  # whole super-blocks of 256 (a K-quant row always is)
        return g.shape[1] % 256 == 0
    if g.shape[1] % 32:
        return False
    if isinstance(g, Int8Groups):
        return g.group_size in (16, 32)
    return g.group_size == 32


def pack_stored(g: StoredGroups, act8: bool = False, super_blocks: bool = False) -> native.Packed | None:
    """A checkpoint's stored weight in the layout of its native kernel (None: none takes it): 4-bit groups
    in the q4 layout (act8: q4a8), 5-bit in q5's, int8 in q8b's, IQ4 codes in iq4's, Q6_K / Q3_K / Q2_K
    codes in kq's, 16-bit floats in h16's, scales and offsets as compact as exact (compact_scales;
    super_blocks: pack_q4_groups'). Projections, the logits head, experts, embeddings."""
    if not _native_groups(g):
        return None
    if isinstance(g, Int4Groups):
        return pack_q4_groups(g, act8, super_blocks)
    if isinstance(g, Int5Groups):
        return native.pack_q5(g.q, *compact_scales(g.scale.float(), g.offset.float()))
    if isinstance(g, Int8Groups):
        return native.pack_q8_blocked(g.q, g.scale, g.group_size)
    if isinstance(g, Int4CodeGroups):
        return native.pack_iq4(g.q, g.scale, g.codebook)
    if isinstance(g, KQuantGroups):
        return native.pack_kq(g.bits, g.q, g.sub_scale, g.d, g.sub_min, g.dmin)
    return native.pack_half(g.values)


class FastLinear(nn.Module):
    """A drop-in for a float32 nn.Linear on CPU (see the module docstring for the kernels)."""

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        stored: StoredGroups | Sequence[tuple[int, int, StoredGroups]] | None = None,
        act8: bool = False,
    ) -> None:
        """`weight` (out, in) float32 is packed and not kept. `bias` is kept by reference, not copied:
        a bias still being loaded in place (weights.load_weights) is seen once it lands. `stored`: the
        checkpoint's own groups, whole or as (first row, end row, groups) parts (a fused projection
        whose parts were stored in different types, as in Q4_K_M files): every row runs on them where
        the native kernels take every part (runs_stored_only; then `weight` may be None), else decode
        rows do (torch's int4 kernel) and prompt rows run oneDNN on `weight`. `act8`: 4-bit
        groups run on the kernel that quantizes activations to int8 (EngineConfig.int8_activations)."""
        super().__init__()
        self.act8 = act8
        # every row, prompt and decode, on the stored groups' native kernels: no oneDNN copy is packed
        self.every_row = stored is not None and runs_stored_only(stored)
        if weight is None:  # no float32 copy exists (the loader did not expand the stored groups)
            assert stored is not None and self.every_row, "without a weight, groups the native kernels run"
            parts = [(0, 0, stored)] if isinstance(stored, _STORED) else list(stored)
            self.out_features = sum(g.shape[0] for _, _, g in parts)
            self.in_features = parts[0][2].shape[1]
        else:
            assert weight.device.type == "cpu" and weight.dtype == torch.float32, (
                "FastLinear is a float32 CPU path"
            )
            self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        # Opaque oneDNN tensor, packed for decode-sized batches (it serves any batch size); None when
        # every row runs the native kernels.
        self.packed: torch.Tensor | None = None
        self.group_size = 0
        # native q4 kernel: the groups in its layout, scales and offsets float16 where exact, else float32
        self.q4: native.Q4Packed | None = None
        self._lib: ctypes.CDLL | None = None
        # torch's int4 kernel: packed weight and (in / group, out, 2) bfloat16 scales and zeros
        self.int4_weight: torch.Tensor | None = None
        self.int4_scale_zeros: torch.Tensor | None = None
        # by parts (any stored forms but all-4-bit): native kernels, one call per part
        self.parts: list[tuple[int, int, native.Packed]] = []
        if isinstance(stored, _STORED):
            stored = [(0, self.out_features, stored)]
        if stored:
            self._pack_stored(list(stored))
        if not self.every_row:
            assert weight is not None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().contiguous(), _ONEDNN_PACK_ROWS
            )

    @classmethod
    def from_packed(
        cls,
        packed: native.Q4Packed | Sequence[tuple[int, int, native.Packed]],
        bias: torch.Tensor | None = None,
        act8: bool = False,
    ) -> FastLinear:
        """A FastLinear that runs every row on weights already in their kernels' layouts (what
        `packed_weights` of an every-row FastLinear gave, e.g. memory-mapped back from
        loading/pack_cache.py): a whole Q4Packed (the all-4-bit form) or (first row, end row, packed)
        parts. Nothing is packed or copied; the tensors are held by reference."""
        lib = _native()
        assert lib is not None, "weights in the native layouts need the native kernels"
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.act8, self.every_row, self._lib = act8, True, lib
        self.bias = None if bias is None else bias.detach()
        self.packed, self.int4_weight, self.int4_scale_zeros = None, None, None
        if isinstance(packed, native.Q4Packed):
            self.q4, self.group_size, self.parts = packed, 32, []
            self.out_features, self.in_features = packed.out_features, packed.in_features
        else:
            self.q4, self.group_size, self.parts = None, 0, list(packed)
            assert self.parts and self.parts[0][0] == 0, "parts must start at row 0"
            assert all(a[1] == b[0] for a, b in zip(self.parts, self.parts[1:], strict=False)), (
                "parts must be contiguous"
            )
            self.out_features, self.in_features = self.parts[-1][1], self.parts[0][2].in_features
        return self

    @property
    def packed_weights(self) -> native.Q4Packed | list[tuple[int, int, native.Packed]] | None:
        """Every row's weights in their native layouts, as from_packed takes them back; None unless
        every row runs the native kernels (a oneDNN or torch int4 packing is opaque)."""
        if not self.every_row:
            return None
        if self.q4 is not None:
            return self.q4
        return list(self.parts) if self.parts else None

    def _pack_stored(self, parts: list[tuple[int, int, StoredGroups]]) -> None:
        assert parts[0][0] == 0 and parts[-1][1] == self.out_features, "parts must cover every row"
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False)), "parts must be contiguous"
        if all(isinstance(g, Int4Groups) for _, _, g in parts):
            self._pack_int4(Int4Groups.cat([g for _, _, g in parts]))  # type: ignore[misc]
            return
        lib = _native()
        if lib is None:
            return  # these forms run on the native kernels only: oneDNN takes every row
        packed: list[tuple[int, int, native.Packed]] = []
        for start, end, g in _merge_runs(parts):
            assert g.shape == (end - start, self.in_features), "stored groups do not match the weight"
            p = pack_stored(g, self.act8, super_blocks=True)
            if p is None:
                return
            packed.append((start, end, p))
        self.parts, self._lib = packed, lib

    def _pack_int4(self, g: Int4Groups) -> None:
        assert tuple(g.q.shape) == (self.out_features, self.in_features), (
            "int4 groups do not match the weight"
        )
        lib = _native()
        if g.group_size == 32 and self.in_features % 32 == 0 and lib is not None:
            self.group_size = 32
            self.q4 = pack_q4_groups(g, self.act8, super_blocks=True)
            self._lib = lib
        elif int4_shape_ok(self.out_features, self.in_features, g.group_size):
            self.group_size = g.group_size
            self.int4_weight = torch._convert_weight_to_int4pack_for_cpu(
                g.q.to(torch.int32), _INT4_INNER_K_TILES
            )
            # torch's layout: w = (q - 8) * scale + zero, so zero = offset + 8 * scale.
            # (num_groups, out_features, 2) bfloat16
            scale_zeros = torch.stack((g.scale, g.offset + 8 * g.scale), dim=-1).transpose(0, 1)
            self.int4_scale_zeros = scale_zeros.contiguous().to(torch.bfloat16)

    @property
    def has_decode_kernel(self) -> bool:
        """Whether decode rows run on the checkpoint's own groups (else oneDNN float32 like prompt rows)."""
        return self.q4 is not None or self.int4_weight is not None or bool(self.parts)

    @property
    def int8_activations(self) -> bool:
        """Whether some of its rows' activations are rounded to int8 (act8 applies to 4-bit groups)."""
        return self.act8 and (
            self.q4 is not None or any(isinstance(g, native.Q4Packed) for _, _, g in self.parts)
        )

    @property
    def decode_kernel(self) -> str | None:
        """What decode rows run on: "native int4", "torch int4", "native int5", "native int8", "native
        bf16", "native int4+int8" (a fused projection stored in two types), ..., or None (oneDNN float32)."""
        if self.q4 is not None:
            return "native int4"
        if self.int4_weight is not None:
            return "torch int4"
        kinds = {native.kind(g) for _, _, g in self.parts}
        return f"native {'+'.join(sorted(kinds))}" if kinds else None

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """x (..., in_features); `decode_rows`: how many of its first rows are decode tokens (None: see
        num_decode_rows)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        # every row on the native kernels; else decode rows on the stored groups, prompt rows oneDNN
        if self.every_row:
            num_small = rows
        else:
            num_small = num_decode_rows(rows, decode_rows) if self.has_decode_kernel else 0
        if num_small == rows:
            y = self._on_stored(x2)
        elif num_small == 0:
            y = self._onednn(x2)
        else:  # a mixed step: decode rows first, prompt rows after
            y = torch.cat((self._on_stored(x2[:num_small]), self._onednn(x2[num_small:])))
        return y.view(*lead, self.out_features)

    def _onednn(self, x2: torch.Tensor) -> torch.Tensor:
        assert self.packed is not None, "no oneDNN weight: every row runs the native kernels"
        return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")

    def _on_stored(self, x2: torch.Tensor) -> torch.Tensor:
        """The rows on the stored groups' kernels (native, or torch's int4 for decode rows)."""
        threads = torch.get_num_threads()
        if self.q4 is not None and self._lib is not None:
            return native.q4_gemm(self._lib, x2.contiguous(), self.q4, self.bias, threads)
        if self.parts:
            assert self._lib is not None
            x2 = x2.contiguous()
            if len(self.parts) == 1:  # the bias added in the kernel: the same float32 add as below
                return native.matmul(self._lib, x2, self.parts[0][2], self.bias, threads)
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            for start, end, g in self.parts:
                y[:, start:end] = native.matmul(self._lib, x2, g, None, threads)
            if self.bias is not None:
                y += self.bias
            return y
        assert self.int4_weight is not None and self.int4_scale_zeros is not None
        y = torch._weight_int4pack_mm_for_cpu(
            x2.to(torch.bfloat16), self.int4_weight, self.group_size, self.int4_scale_zeros
        ).float()
        if self.bias is not None:
            y += self.bias
        return y

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights one call over `rows` rows (not told its decode rows) streams."""
        if self.q4 is not None:
            return self.q4.nbytes
        if self.has_decode_kernel and (self.every_row or rows <= INT4_MAX_ROWS):
            if self.parts:
                return sum(g.nbytes for _, _, g in self.parts)
            return sum(_nbytes(t) for t in (self.int4_weight, self.int4_scale_zeros) if t is not None)
        return self.in_features * self.out_features * 4

    def extra_repr(self) -> str:
        if self.every_row:
            kind = f"{self.decode_kernel}, every row"
        else:
            kind = f"{self.decode_kernel} decode + onednn" if self.has_decode_kernel else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels={kind}"


def _merge_runs(parts: list[tuple[int, int, StoredGroups]]) -> list[tuple[int, int, StoredGroups]]:
    """Adjacent parts of one form (quants.cat_rows) as one (q, k and v all Q8_0: one int8 part), so a
    projection stored in one type runs one kernel call."""
    merged: list[tuple[int, int, StoredGroups]] = []
    for start, end, g in parts:
        both = cat_rows([merged[-1][2], g]) if merged else None
        if both is not None:
            merged[-1] = (merged[-1][0], end, both)
        else:
            merged.append((start, end, g))
    return merged


def compact_scales(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and offsets as float16 when that is exact (Q4_0/Q4_1 store them in float16), else
    float32 (Q4_K's are products of two stored numbers)."""
    half_scale, half_offset = scale.half(), offset.half()
    if torch.equal(half_scale.float(), scale) and torch.equal(half_offset.float(), offset):
        return half_scale.contiguous(), half_offset.contiguous()
    return scale.contiguous(), offset.contiguous()


def pack_q4_groups(g: Int4Groups, act8: bool = False, super_blocks: bool = False) -> native.Q4Packed:
    """A checkpoint's 4-bit groups of 32 in the native q4 layout (act8: q4a8), with their scales and
    offsets as compact as exact (compact_scales): projections, the logits head, a stored embedding.
    super_blocks (the projections, which only the GEMMs read): where float16 is not exact, Q4_K's
    super-block factors when they reproduce the float32 values (native.pack_q4_super: 0.58 bytes a
    weight where float32 scales take 0.75; the kernels compute the same float32 scales from them)."""
    scale, offset = compact_scales(g.scale.float(), g.offset.float())
    if super_blocks and not act8 and scale.dtype == torch.float32:
        packed = native.pack_q4_super(g.q, scale, offset)
        if packed is not None:
            return packed
    return native.pack_q4(g.q, scale, offset, act8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FastLMHead(nn.Module):
    """The logits projection on the checkpoint's own stored weight where it stored the (possibly tied)
    output weight in a form a native kernel runs (`stored`, packed by pack_stored: int8 groups on the
    q8b kernel, 4-bit groups on q4's, 5-bit on q5's, F16/BF16 on the half GEMM); without them, a Q8_0
    weight is found by re-quantizing the float weight; else a oneDNN-prepacked float32 copy. The
    group kernels round activations to int16 steps per group of 32, as the projections' do (their
    tolerances: tests/kernels/test_native_kernels.py, test_quant_kernels.py)."""

    def __init__(self, weight: torch.Tensor, stored: StoredGroups | None = None) -> None:
        super().__init__()
        w = weight.detach().float().contiguous()
        self.num_weights = w.numel()
        self.table: native.Packed | None = None  # the weight in its native kernel's layout
        self.packed: torch.Tensor | None = None
        self.from_stored = False  # table holds the checkpoint's own weight (bit-exact), no re-quantization
        usable = stored is not None and stored.shape == tuple(w.shape) and runs_stored_only(stored)
        if usable:
            assert stored is not None
            self.table = pack_stored(stored)
            self.from_stored = self.table is not None
        elif w.is_meta:  # the loader skipped the float32 matrix only for groups the rule above takes
            raise ValueError(
                "the output weight was left to its stored groups, but they are not ones the native kernels run"
            )
        elif w.shape[1] % 32 == 0 and _native() is not None:
            q, scale = native.quantize_q8_groups(w)
            err = (q.view(w.shape[0], -1, 32).float() * scale.unsqueeze(-1)).view_as(w).sub_(w).abs_().max()
            if float(err) <= _Q8_EXACT_RTOL * float(w.abs().max()):
                self.table = native.pack_q8_blocked(q, scale)
        if self.table is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _ONEDNN_PACK_ROWS)

    @classmethod
    def from_table(cls, table: native.Packed) -> FastLMHead:
        """A head on the checkpoint's own weight already in its kernel's layout (`table` of a head
        built `from_stored`, e.g. memory-mapped back from loading/pack_cache.py): nothing is packed."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.num_weights = table.out_features * table.in_features
        self.table, self.packed, self.from_stored = table, None, True
        return self

    @property
    def q8(self) -> native.Q8Blocked | None:
        return self.table if isinstance(self.table, native.Q8Blocked) else None

    @property
    def q4(self) -> native.Q4Packed | None:
        return self.table if isinstance(self.table, native.Q4Packed) else None

    @property
    def kernel(self) -> str:
        """ "native q8", "native q4", "native q5", "native f16", "native bf16" or "onednn float32"."""
        if self.table is None:
            return "onednn float32"
        kind = native.kind(self.table)
        return f"native {kind.replace('int', 'q')}"

    def weight_bytes_read(self) -> int:
        return self.num_weights * 4 if self.table is None else self.table.nbytes

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float().contiguous()
        if self.table is not None:
            lib = _native()
            assert lib is not None
            return native.matmul(lib, x, self.table, None, torch.get_num_threads())
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
