"""Fast CPU matmuls behind one switch (EngineConfig.kernels = "fast"); nn.Linear is the reference.

Decode on a CPU is bound by how fast the weights stream through the cores, and
torch's default float32 GEMM (MKL) streams them slowly at the skinny shapes of
decode: measured on this project's 2-core AMD machine (benchmarks/README numbers),
a batch of 16 tokens through SmolLM2-135M's projections ran at ~20 GFLOP/s. Two
kernels that ship inside torch do better, and this module picks between them per call:

* oneDNN with the weight prepacked once into its blocked layout
  (`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`): same float32
  math as the reference (only the summation order differs), ~1.5-2x faster than
  MKL from batch 1 up to prefill chunks of 512.
* torch's int4 group-quantized kernel (`_weight_int4pack_mm_for_cpu`) for calls of
  at most INT4_MAX_ROWS rows, used only when the checkpoint itself stored the weight in
  4-bit groups of 32 (GGUF Q4_0/Q4_1/Q4_K, see quants.Int4Groups): the same weights as
  the file, at an eighth of float32's bytes. Its activations, scales and zeros are
  bfloat16, so its outputs differ from the float32 reference by bfloat16 rounding
  (tolerance in tests/test_fast_linear.py).

Numerics are therefore batch-variant on the fast path (a token computed in a small
decode batch goes through int4, one in a prefill chunk through oneDNN). The
reference path (`kernels="reference"`) is the oracle the tests compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from onecall.model.quants import Int4Groups

# Calls with at most this many rows use the int4 kernel when one is available. Its cost grows about
# linearly with rows while oneDNN's GEMM amortises the weight reads; measured for SmolLM2-135M's
# projections on 2 cores (all 30 layers, ms): rows 4: int4 21 / oneDNN 53; 12: 43 / 71; 16: 77 / 79.
INT4_MAX_ROWS = 16
# oneDNN packs a weight for an expected batch size; any batch works with any packing, but packing for
# 16 rows ran batch-16 decode 1.3x faster than packing for 1 (67 vs 87 ms) at no cost for 1 row.
_ONEDNN_PACK_ROWS = 16
_INT4_INNER_K_TILES = 2  # packing parameter of torch's CPU int4 layout


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def fast_kernels_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """The fast kernels are a float32 CPU path; elsewhere the reference modules stay."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and onednn_available()


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes torch's CPU int4 kernel accepts: whole groups along K, N in blocks of 16."""
    return in_features % group_size == 0 and in_features % 2 == 0 and out_features % 16 == 0


class FastLinear(nn.Module):
    """A drop-in for a float32 nn.Linear on CPU (see the module docstring for the two kernels)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, int4: Int4Groups | None = None
    ) -> None:
        """`weight` (out, in) float32 is packed and not kept. `bias` is kept by reference, not copied:
        a bias still being loaded in place (DecoderLM.load_weights) is seen once it lands."""
        super().__init__()
        assert weight.device.type == "cpu" and weight.dtype == torch.float32, (
            "FastLinear is a float32 CPU path"
        )
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        # Opaque oneDNN tensor, packed for decode-sized batches (it serves any batch size).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _ONEDNN_PACK_ROWS)
        self.int4_weight: torch.Tensor | None = None
        self.int4_scale_zeros: torch.Tensor | None = None
        self.group_size = 0
        if int4 is not None and int4_shape_ok(self.out_features, self.in_features, int4.group_size):
            self._pack_int4(int4)

    def _pack_int4(self, g: Int4Groups) -> None:
        assert tuple(g.q.shape) == (self.out_features, self.in_features), (
            "int4 groups do not match the weight"
        )
        self.group_size = g.group_size
        self.int4_weight = torch._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), _INT4_INNER_K_TILES)
        # torch's layout: w = (q - 8) * scale + zero, so zero = offset + 8 * scale.
        # (num_groups, out_features, 2) bfloat16
        scale_zeros = torch.stack((g.scale, g.offset + 8 * g.scale), dim=-1).transpose(0, 1)
        self.int4_scale_zeros = scale_zeros.contiguous().to(torch.bfloat16)

    @property
    def has_int4(self) -> bool:
        return self.int4_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.int4_weight is not None and x2.shape[0] <= INT4_MAX_ROWS:
            assert self.int4_scale_zeros is not None
            y = torch._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.int4_weight, self.group_size, self.int4_scale_zeros
            ).float()
            if self.bias is not None:
                y += self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights one call over `rows` rows streams (int4 data + bf16 scales, or float32)."""
        if self.int4_weight is not None and self.int4_scale_zeros is not None and rows <= INT4_MAX_ROWS:
            return _nbytes(self.int4_weight) + _nbytes(self.int4_scale_zeros)
        return self.in_features * self.out_features * 4

    def extra_repr(self) -> str:
        kind = f"int4 g{self.group_size} (<= {INT4_MAX_ROWS} rows) + onednn" if self.has_int4 else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels={kind}"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FastLMHead(nn.Module):
    """The logits projection over a oneDNN-prepacked copy of the (possibly tied) output weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().float().contiguous(), _ONEDNN_PACK_ROWS
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            hidden.float().contiguous(), self.packed, None, "none", [], ""
        )


@dataclass
class PackSlot:
    """One projection to pack: the module attribute its FastLinear replaces, and the checkpoint
    tensors that fill its rows (a fused q/k/v or gate/up weight has several)."""

    owner: nn.Module
    attr: str
    shape: tuple[int, int]  # (out_features, in_features)
    parts: dict[str, tuple[int, int]]  # checkpoint name -> (first row, end row), in row order
    bias: torch.Tensor | None


class StreamingPacker:
    """Packs projections into FastLinear modules while the checkpoint streams in.

    `accept(name, tensor)` takes a projection's part: a single-part weight is packed as it is,
    the parts of a fused one are gathered in a staging tensor. When a projection is complete it is
    packed on a worker thread (torch's packing ops release the GIL) while loading goes on. So no
    dense float32 copy of the projections is ever a parameter: each lives only until packed, and
    cold start pays neither their first-touch page faults nor a copy (about 0.4 s for
    SmolLM2-135M's 424 MB on this machine). `finish` installs the modules and packs the logits.
    """

    def __init__(self, slots: list[PackSlot], int4: Mapping[str, Int4Groups], workers: int) -> None:
        self.slots = slots
        self._slot_of = {name: (slot, rows) for slot in slots for name, rows in slot.parts.items()}
        self._int4 = int4  # may still be filling: a part's groups are stored before it is yielded
        self._staging: dict[int, tuple[torch.Tensor, set[str]]] = {}  # id(slot) -> (weight, missing)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers))
        self._jobs: list[tuple[PackSlot, Future[FastLinear]]] = []

    def accept(self, name: str, tensor: torch.Tensor) -> bool:
        """Take `tensor` if it is part of a projection (shape already checked); False otherwise."""
        entry = self._slot_of.get(name)
        if entry is None:
            return False
        slot, (start, end) = entry
        if len(slot.parts) == 1:
            self.submit(slot, tensor)
            return True
        weight, missing = self._staging.setdefault(
            id(slot), (torch.empty(slot.shape, dtype=torch.float32), set(slot.parts))
        )
        weight[start:end].copy_(tensor)
        missing.discard(name)
        if not missing:
            del self._staging[id(slot)]
            self.submit(slot, weight)
        return True

    def submit(self, slot: PackSlot, weight: torch.Tensor) -> None:
        """Pack `slot` from its whole (out, in) weight on a worker thread."""
        groups = [self._int4.get(name) for name in slot.parts]
        fused = Int4Groups.cat([g for g in groups if g is not None]) if all(groups) else None
        self._jobs.append((slot, self._pool.submit(FastLinear, weight, slot.bias, fused)))

    def finish(self, output_weight: torch.Tensor) -> tuple[FastLMHead, list[FastLinear]]:
        """Wait for every packing, swap each FastLinear in, and pack the logits projection."""
        try:
            head = self._pool.submit(FastLMHead, output_weight)
            modules = [job.result() for _, job in self._jobs]
            for (slot, _), module in zip(self._jobs, modules, strict=True):
                setattr(slot.owner, slot.attr, module)
            return head.result(), modules
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
