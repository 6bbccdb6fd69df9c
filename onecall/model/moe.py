"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks top-k experts per token, each a gated MLP.

    router_logits = x W_router^T                          (num_tokens, num_experts)
    probs = softmax(router_logits) in float32             over every expert
    w, e = top_k(probs)                                   (num_tokens, top_k) each
    w = w / sum(w)        if norm_topk_prob               (Mixtral always; Qwen3-MoE per config)
    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))   for e = e[t, j]
    out[t] += sigmoid(x[t] . w_shared_gate) * shared_expert(x[t])      Qwen3-Next / Qwen3.5-MoE only

Expert weights are stacked, as transformers 5 holds them and as a GGUF stores them:
`experts.gate_up_proj` (num_experts, 2 * moe_intermediate, hidden) with rows [gate; up] per expert,
`experts.down_proj` (num_experts, hidden, moe_intermediate). The loader stacks checkpoints that
store one tensor per expert (loading/weights.py).

The forward groups the step's (token, expert) assignments by expert, so each expert runs one matmul
over the rows routed to it, and adds the weighted results back with index_add_. Only experts that
received a row run: at batch 1 that is top_k of num_experts. Reading the per-expert counts back
(.tolist()) is one host sync per layer; on CPU it is free, on a GPU it is what keeps this path out of
CUDA graph capture (a grouped-GEMM kernel would remove it).

A quantized GGUF's experts keep their own groups on the fast path (Experts.use_stored, called by
loading/weights.py with kernels/cpu/experts.py's NativeExperts) and run on the native kernels
FastLinear uses, as projections do (kernels/cpu/fast_linear.py):

| stored as             | every row (decode and prompt) | float32 weight kept                       |
|-----------------------|-------------------------------|-------------------------------------------|
| Q4_0 / Q4_1 / Q4_K    | native int4 (1/8 bytes)       | no (freed when every expert of the weight |
| Q8_0 / Q6_K           | native int8 (1/4 bytes)       | kind has groups; the loader may leave it  |
|                       |                               | unfilled: loading/weights.py)             |
| anything else         | float32 F.linear              | yes                                       |

per expert and weight (gate_up, down). One kernel for every row keeps a token's result independent
of the rest of its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import ExpertKernels
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
        # one expert's gate_up and down shapes (known after use_stored frees the weights)
        self.weight_shapes = ((2 * i, h), (h, i))
        # the experts' weights a kernel holds in the checkpoint's own groups (use_stored), if any
        self.stored: ExpertKernels | None = None

    def use_stored(self, kernels: ExpertKernels | None) -> bool:
        """Run the weights `kernels` holds on them from now on (the loader builds it:
        kernels/cpu/experts.py's native_experts); the rest stays on its float32 copy. A weight kind
        whose every expert is held never reads its float32 copy again, which is then freed: the loader
        may have left it unfilled. False, nothing changed, for None."""
        if kernels is None:
            return False
        self.stored = kernels
        for which, param in enumerate((self.gate_up_proj, self.down_proj)):
            if kernels.covers(which):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return True

    def bytes_read(self, rows: int, top_k: int) -> int:
        """Bytes of expert weights a forward over `rows` tokens streams at most: the experts those rows
        can reach (rows * top_k, at most all of them), an average expert's worth each, every weight in
        the form its kernel reads (stored groups, else float32)."""
        total = 0
        for e in range(self.num_experts):
            for which, param in enumerate((self.gate_up_proj, self.down_proj)):
                held = None if self.stored is None else self.stored.nbytes(e, which)
                rows_, cols = self.weight_shapes[which]
                total += held if held is not None else rows_ * cols * param.element_size()
        return total * min(self.num_experts, rows * top_k) // self.num_experts

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
        """Expert e's gate_up (which 0) or down (1) projection of rows h: every row on the held
        groups' kernel, or in float32 where the expert has none for that weight."""
        out = None if self.stored is None else self.stored.project(h, e, which)
        if out is None:
            return F.linear(h, (self.gate_up_proj if which == 0 else self.down_proj)[e])
        return out


class SparseMoE(nn.Module):
    """The MoE block in a decoder layer's MLP slot: `gate` (the router, no bias) and `experts`; with a
    `shared_expert` (a gated MLP every token goes through, built by the caller) also its
    `shared_expert_gate` (hidden -> 1, no bias), as Qwen3-Next and Qwen3.5-MoE name them."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        assert 0 < top_k <= num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype, device)
        self.shared_expert = shared_expert  # forward(x, decode_rows), as model/layers.py's MLP
        self.shared_expert_gate = (
            None if shared_expert is None else Linear(hidden_size, 1, bias=False, dtype=dtype, device=device)
        )

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """x (num_tokens, hidden). Every row of an expert runs on one kernel, so `decode_rows` (the
        MLP's signature) changes nothing for them; the shared expert's projections get it."""
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, decode_rows)
        return out

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights a forward over `rows` tokens streams at most: the router, and the experts
        those rows can reach (rows * top_k, at most all of them), each in the form its kernel reads
        (stored groups, else float32), an average expert's worth each."""
        router = self.gate.weight.numel() * self.gate.weight.element_size()
        # the shared expert and its gate, every row: their parameters (a projection the fast kernels
        # packed holds none: the caller counts it as it counts every packed projection)
        shared = 0
        for module in (self.shared_expert, self.shared_expert_gate):
            if module is not None:
                shared += sum(p.numel() * p.element_size() for p in module.parameters())
        return router + self.experts.bytes_read(rows, self.top_k) + shared
