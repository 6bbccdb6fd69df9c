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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecall.model.layers import Linear


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
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # (count, hidden)
            out.index_add_(0, rows, y * scale[start : start + count])
            start += count
        return out


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
