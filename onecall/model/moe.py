"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks top-k experts per token, each a gated MLP.

    router_logits = x W_router^T                          (num_tokens, num_experts)
    probs = softmax(router_logits) in float32             over every expert
    w, e = top_k(probs)                                   (num_tokens, top_k) each
    w = w / sum(w)        if norm_topk_prob               (Mixtral always; Qwen3-MoE per config)
    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))   for e = e[t, j]

Expert weights are stacked, as transformers 5 holds them and as a GGUF stores them:
`experts.gate_up_proj` (num_experts, 2 * moe_intermediate, hidden) with rows [gate; up] per expert,
`experts.down_proj` (num_experts, hidden, moe_intermediate). The loader stacks checkpoints that
store one tensor per expert (model/weights.py).

The forward groups the step's (token, expert) assignments by expert, so each expert runs one matmul
over the rows routed to it, and adds the weighted results back with index_add_. Only experts that
received a row run: at batch 1 that is top_k of num_experts. Reading the per-expert counts back
(.tolist()) is one host sync per layer; on CPU it is free, on a GPU it is what keeps this path out of
CUDA graph capture (a grouped-GEMM kernel would remove it).

A quantized GGUF's experts keep their own groups on the fast path (Experts.use_stored, called by
model/weights.py) and run on the native kernels FastLinear uses (kernels/cpu/native.py), as projections do
(kernels/cpu/fast_linear.py):

| stored as             | every row (decode and prompt) | float32 weight kept                       |
|-----------------------|-------------------------------|-------------------------------------------|
| Q4_0 / Q4_1 / Q4_K    | native int4 (1/8 bytes)       | no (freed when every expert of the weight |
| Q8_0 / Q6_K           | native int8 (1/4 bytes)       | kind has groups; the loader may leave it  |
|                       |                               | unfilled: model/weights.py)               |
| anything else         | float32 F.linear              | yes                                       |

per expert and weight (gate_up, down). One kernel for every row keeps a token's result independent
of the rest of its batch.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from onecall.formats.quants import Int4Groups, Int8Groups, StoredGroups
from onecall.kernels.cpu import native
from onecall.model.layers import Linear

ExpertGroups = native.Q4Packed | native.Q8Blocked  # one expert weight in the form its decode kernel reads


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, num_experts) logits -> (weights (num_tokens, top_k) in the logits' dtype, expert ids
    (num_tokens, top_k) int64). Softmax over every expert in float32, then the top k, renormalised to
    sum to 1 when `norm_topk_prob`."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class Experts(nn.Module):
    """num_experts gated MLPs (SiLU), weights stacked on a leading expert axis."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))  # [gate; up]
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))
        # one expert's gate_up and down shapes (known after use_stored frees the weights)
        self.weight_shapes = ((2 * i, h), (h, i))
        # per expert (gate_up, down) in the checkpoint's own groups, None where a weight has none (use_stored)
        self.stored: list[tuple[ExpertGroups | None, ExpertGroups | None]] | None = None
        self._lib: ctypes.CDLL | None = None

    def use_stored(
        self,
        gate_up: list[StoredGroups | native.Q4Packed | native.Q8Blocked | None],
        down: list[StoredGroups | native.Q4Packed | native.Q8Blocked | None],
        act8: bool = False,
    ) -> bool:
        """Per expert, the checkpoint's own groups of gate_up (rows [gate; up]) and down, or None: that
        weight runs on its float32 copy. Groups the native kernels do not take (a group size or K they
        do not run) count as None. A weight kind whose every expert has groups (4-bit or int8) never
        reads its float32 copy again, which is then freed: the loader may have left it unfilled
        (model/weights.py).
        False, and nothing kept, without the native library or with no groups at all. `act8`: 4-bit
        groups given unpacked are packed for the int8-activation kernel (int8_activations)."""
        lib = native.load()
        assert len(gate_up) == len(down) == self.num_experts
        stored = [
            (_for_kernel(gu, self.weight_shapes[0], act8), _for_kernel(d, self.weight_shapes[1], act8))
            for gu, d in zip(gate_up, down, strict=True)
        ]
        if lib is None or all(a is None and b is None for a, b in stored):
            return False
        self.stored, self._lib = stored, lib
        for which, param in enumerate((self.gate_up_proj, self.down_proj)):
            if all(p[which] is not None for p in stored):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (num_tokens, hidden); weights, experts (num_tokens, top_k) -> (num_tokens, hidden)."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)  # assignment a = token * top_k + j
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k
        scale = weights.reshape(-1)[order].unsqueeze(1)  # (num_assignments, 1)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = self._project(x[rows], e, 0).chunk(2, dim=-1)
            y = self._project(F.silu(gate) * up, e, 1)  # (count, hidden)
            out.index_add_(0, rows, y * scale[start : start + count])
            start += count
        return out

    def _project(self, h: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """Expert e's gate_up (which 0) or down (1) projection of rows h: every row on the stored groups'
        kernel, or in float32 where the expert has none for that weight."""
        groups = None if self.stored is None else self.stored[e][which]
        if groups is None:
            return F.linear(h, (self.gate_up_proj if which == 0 else self.down_proj)[e])
        assert groups is not None and self._lib is not None
        rows, threads = h.contiguous(), torch.get_num_threads()
        if isinstance(groups, native.Q8Blocked):
            return native.q8_blocked_gemm(self._lib, rows, groups, None, threads)
        return native.q4_gemm(self._lib, rows, groups, None, threads)


def _for_kernel(
    groups: StoredGroups | native.Q4Packed | native.Q8Blocked | None, shape: tuple[int, int], act8: bool
) -> ExpertGroups | None:
    """One expert weight's stored groups in the native kernels' form, or None if they do not run it."""
    rows, cols = shape
    if isinstance(groups, (native.Q4Packed, native.Q8Blocked)):
        return groups if (groups.out_features, groups.in_features) == shape else None
    if groups is None or tuple(groups.q.shape) != (rows, cols) or cols % 32:
        return None
    if isinstance(groups, Int8Groups) and groups.group_size in (16, 32):
        return native.pack_q8_blocked(groups.q, groups.scale, groups.group_size)
    if isinstance(groups, Int4Groups) and groups.group_size == 32:
        return pack_int4(groups, act8)
    return None


def pack_int4(groups: Int4Groups, act8: bool = False) -> native.Q4Packed:
    """4-bit groups of 32 in the native int4 kernel's layout (float32 scales and offsets); act8: the
    layout of the kernel that quantizes activations to int8 (native.pack_q4)."""
    scale, offset = groups.scale.float().contiguous(), groups.offset.float().contiguous()
    return native.pack_q4(groups.q, scale, offset, act8)


class SparseMoE(nn.Module):
    """The MoE block in a decoder layer's MLP slot: `gate` (the router, no bias) and `experts`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        assert 0 < top_k <= num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.experts(x, weights, experts)

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights a forward over `rows` tokens streams at most: the router, and the experts
        those rows can reach (rows * top_k, at most all of them), each in the form its kernel reads
        (stored groups, else float32), an average expert's worth each."""
        experts = self.experts
        per_expert = 0
        for e in range(experts.num_experts):
            for which, param in enumerate((experts.gate_up_proj, experts.down_proj)):
                groups = None if experts.stored is None else experts.stored[e][which]
                if groups is not None:  # every row on its groups
                    per_expert += groups.nbytes
                else:
                    rows_, cols = experts.weight_shapes[which]
                    per_expert += rows_ * cols * param.element_size()
        reached = min(experts.num_experts, rows * self.top_k)
        router = self.gate.weight.numel() * self.gate.weight.element_size()
        return router + per_expert * reached // experts.num_experts
