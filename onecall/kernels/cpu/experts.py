"""A MoE layer's experts on the native kernels: each expert weight in the checkpoint's own groups.

A quantized GGUF stores every expert's gate, up and down weights in a stored form (quants.py's table:
4-bit or 5-bit groups, int8 groups, 4-bit codebook codes (IQ4, and gpt-oss's MXFP4), or 16-bit
floats). NativeExperts holds, per expert, gate_up (rows [gate; up]) and down in the layout their kernel
reads (native.Packed: fast_linear.pack_stored), or None where that weight runs on its float32 copy (a
form the kernels do not take: a group size or a K they do not run). Every row, decode and prompt alike,
of a held weight runs on its kernel (csrc/gemm.c), as FastLinear's stored parts do.
model/moe.py's Experts asks it through kernels/ops.py's ExpertKernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from onecall.formats.quants import Int4Groups, StoredGroups
from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_linear import pack_stored

ExpertGroups = native.Packed  # one expert weight in the layout its kernel reads
_PACKED = (  # native.Packed's members
    native.Q4Packed,
    native.Q5Packed,
    native.Q8Blocked,
    native.IQ4Packed,
    native.KQPacked,
    native.HalfPacked,
)


class NativeExperts:
    """Per expert (gate_up, down) on the native kernels, None where a weight has no groups they run."""

    def __init__(
        self, lib: ctypes.CDLL, weights: list[tuple[ExpertGroups | None, ExpertGroups | None]]
    ) -> None:
        self._lib = lib
        self.weights = weights

    def covers(self, which: int) -> bool:
        """Whether every expert's gate_up (which 0) or down (1) runs here: its float32 copy is unused."""
        return all(w[which] is not None for w in self.weights)

    def nbytes(self, expert: int, which: int) -> int | None:
        """Bytes the kernel streams for that weight, None where it runs in float32."""
        groups = self.weights[expert][which]
        return None if groups is None else groups.nbytes

    def kinds(self) -> set[str]:
        """ "int4", "int5", "int8", "iq4", "mxfp4", "f16", "bf16": the kernels the held weights run on."""
        return {native.kind(g) for pair in self.weights for g in pair if g is not None}

    def project(self, rows: torch.Tensor, expert: int, which: int) -> torch.Tensor | None:
        """rows (n, in) float32 through that weight, (n, out); None where it runs in float32."""
        groups = self.weights[expert][which]
        if groups is None:
            return None
        return native.matmul(self._lib, rows.contiguous(), groups, None, torch.get_num_threads())


def native_experts(
    gate_up: Sequence[StoredGroups | ExpertGroups | None],
    down: Sequence[StoredGroups | ExpertGroups | None],
    shapes: tuple[tuple[int, int], tuple[int, int]],
    act8: bool = False,
) -> NativeExperts | None:
    """Per expert, the checkpoint's own groups of gate_up and down (or None), in the kernels' form:
    None, nothing held, without the native library or where no weight has groups they run. `shapes`:
    one expert's (gate_up, down) (out, in); `act8`: 4-bit groups given unpacked are packed for the
    int8-activation kernel (EngineConfig.int8_activations)."""
    lib = native.load()
    assert len(gate_up) == len(down)
    weights = [
        (for_kernel(gu, shapes[0], act8), for_kernel(d, shapes[1], act8))
        for gu, d in zip(gate_up, down, strict=True)
    ]
    if lib is None or all(a is None and b is None for a, b in weights):
        return None
    return NativeExperts(lib, weights)


def for_kernel(
    groups: StoredGroups | ExpertGroups | None, shape: tuple[int, int], act8: bool = False
) -> ExpertGroups | None:
    """One expert weight's groups in the native kernels' layout, or None if they do not run it."""
    if isinstance(groups, _PACKED):
        return groups if (groups.out_features, groups.in_features) == shape else None
    if groups is None or groups.shape != shape:
        return None
    if isinstance(groups, Int4Groups):
        return pack_int4(groups, act8) if groups.group_size == 32 and shape[1] % 32 == 0 else None
    return pack_stored(groups, act8)


def pack_int4(groups: Int4Groups, act8: bool = False) -> native.Q4Packed:
    """4-bit groups of 32 in the native int4 kernel's layout (float32 scales and offsets); act8: the
    layout of the kernel that quantizes activations to int8 (native.pack_q4)."""
    scale, offset = groups.scale.float().contiguous(), groups.offset.float().contiguous()
    return native.pack_q4(groups.q, scale, offset, act8)
