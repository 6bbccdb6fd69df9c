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


def int4_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    """Shapes torch's CPU int4 kernel accepts: whole groups along K, N in blocks of 16."""
    return in_features % group_size == 0 and in_features % 2 == 0 and out_features % 16 == 0


class FastLinear(nn.Module):
    """A drop-in for a float32 nn.Linear on CPU (see the module docstring for the two kernels)."""

    def __init__(self, linear: nn.Linear, int4: Int4Groups | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        assert weight.device.type == "cpu" and weight.dtype == torch.float32, (
            "FastLinear is a float32 CPU path"
        )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        # Opaque oneDNN tensor, packed for decode-sized batches (it serves any batch size).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_PACK_ROWS)
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
