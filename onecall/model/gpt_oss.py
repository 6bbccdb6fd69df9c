"""gpt-oss (OpenAI's open-weight MoE): what it adds to the decoder of model/layers.py, forward only.

Per layer (transformers' GptOssDecoderLayer), the pre-norm Llama shape with three differences:

    h = h + attn(input_layernorm(h))          q/k/v/o biases, attention sinks, every other layer sliding
    h = h + moe(post_attention_layernorm(h))  a biased router, top-k softmax, clamped SwiGLU experts

| piece          | what transformers computes (checked in tests/model/test_gpt_oss.py)                    |
|----------------|----------------------------------------------------------------------------------------|
| norms          | RMSNorm with a float32 weight: (w * x / rms(x)) in float32, then cast (GemmaRMSNorm's   |
|                | order; the + 1 of Gemma is the loader's, not the module's, so none here)               |
| attention      | q/k/v/o with bias (attention_bias), scale head_dim ** -0.5, RoPE (YaRN in the released |
|                | configs: model/rope.py), sliding layers see their last sliding_window keys (128)       |
| sinks          | one learned logit per query head in each softmax's denominator, no value:              |
|                | out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)); kept in float32 here and      |
|                | passed to paged_attention, which every backend and kernel applies (model/attention.py) |
| router         | logits = x W^T + b; the top k logits (torch.topk); softmax over those k only, in the   |
|                | logits' dtype (equal to renormalising the top k of a softmax over all experts)         |
| experts        | gate_up = x W_gu^T + b_gu; gate = min(gate, limit); up = clamp(up, -limit, limit);     |
|                | glu = gate * sigmoid(alpha * gate); y = ((up + 1) * glu) W_d^T + b_d                    |
|                | (swiglu_alpha 1.702, swiglu_limit 7.0 by default); out = sum_k weight_k * y_k          |

Expert layout: transformers holds gate_up_proj as (experts, hidden, 2 * inter) multiplied from the
right (x @ W), its 2 * inter columns INTERLEAVED: gate is column 2i, up column 2i + 1 (and the same
for gate_up_proj_bias); down_proj (experts, inter, hidden). The released checkpoints store them as
MXFP4 blocks in the (out, in) orientation. We hold them as F.linear weights, moe.Experts' layout:
gate_up_proj (experts, 2 * inter, hidden) with rows [gate; up] (de-interleaved), gate_up_proj_bias
(experts, 2 * inter) the same, down_proj (experts, hidden, inter), down_proj_bias (experts, hidden);
loading/weights.py rewrites transformers' tensors (and dequantizes the MXFP4 ones) into it.

The model part is model/decoder.py's DecoderModel with these layers (gpt_oss_layers) and a final norm
with a float32 weight. The one-call native decode step (loading/native_step.py) takes only DecoderLayer
layers, so it declines this model; the projections of attention run on the fast kernels as any other
family's (their biases included), the norms and RoPE + K/V writes on the native ops, attention on the
native kernels with their sinks. The experts are moe.Experts' (GptOssExperts subclasses it): a GGUF's
MXFP4 experts (their own 4-bit codes, on the iq4 kernel with MXFP4's codebook: formats/quants.py) or
other stored forms run every row on the native kernels in those groups (Experts.use_stored,
kernels/cpu/experts.py), with no float32 copy; the biases are added and the clamped SwiGLU computed in torch between the two projections.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, LayerOps
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.config import SLIDING, GptOssSpec, ModelConfig
from onecall.model.gemma import GemmaRMSNorm
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import Attention, Linear
from onecall.model.moe import Experts


class GptOssAttention(Attention):
    """Attention with q/k/v/o biases (built by Attention from config.attention_bias), this layer's window
    and its attention sinks, `sinks` (num_heads,) float32, as transformers names them."""

    def __init__(
        self,
        config: ModelConfig,
        spec: GptOssSpec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__(config, dtype, device, ops)
        self.sliding_window = spec.sliding_window if spec.layer_types[layer_idx] == SLIDING else None
        # float32 whatever the model dtype: the kernels read them so, and a bfloat16 checkpoint's values
        # are exact in float32
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads, dtype=torch.float32, device=device))

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "sinks": self.sinks}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: gate clamped from above at `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(Experts):
    """num_experts clamped-SwiGLU MLPs with biases, stacked on a leading expert axis (the layout in the
    module docstring). moe.Experts' weights and its use_stored: a quantized GGUF's experts run on the
    native kernels in their stored groups (loading/weights.py hands them over), the biases added after
    each projection and the clamped SwiGLU in torch between them; a weight kind every expert of which
    the kernels hold has its float32 copy freed (the biases are always kept)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        spec: GptOssSpec,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, dtype, device)
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device))  # [gate; up]
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (num_tokens, hidden); weights, experts (num_tokens, top_k) -> (num_tokens, hidden).
        Assignments grouped by expert (ascending, as transformers visits them), one matmul per expert
        over its rows, results weighted and added back with index_add_."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)  # assignment a = token * top_k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k
        scale = weights.reshape(-1)[order].unsqueeze(1)  # (num_assignments, 1)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = self._biased(x[rows], e, 0).chunk(2, dim=-1)
            y = self._biased(clamped_swiglu(gate, up, self.alpha, self.limit), e, 1)  # (count, hidden)
            out.index_add_(0, rows, y * scale[start : start + count])
            start += count
        return out

    def _biased(self, h: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """Expert e's gate_up (which 0) or down (1) projection of rows h with its bias: the held groups'
        kernel then the bias, or one float32 F.linear where the expert has no groups for that weight."""
        bias = (self.gate_up_proj_bias if which == 0 else self.down_proj_bias)[e]
        out = None if self.stored is None else self.stored.project(h, e, which)
        if out is None:
            return F.linear(h, (self.gate_up_proj if which == 0 else self.down_proj)[e], bias)
        return out + bias


class GptOssMoE(nn.Module):
    """The MLP slot of a gpt-oss layer: `router` (hidden -> num_experts, with a bias) and `experts`."""

    def __init__(
        self, config: ModelConfig, spec: GptOssSpec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, "ModelConfig gives every gpt_oss model a MoESpec"
        self.top_k = moe.num_experts_per_tok
        self.router = Linear(config.hidden_size, moe.num_experts, bias=True, dtype=dtype, device=device)
        self.experts = GptOssExperts(
            moe.num_experts, config.hidden_size, moe.moe_intermediate_size, spec, dtype, device
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, hidden) -> (weights (num_tokens, top_k) in x's dtype, expert ids int64): the top
        k router logits, softmax over those k."""
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """x (num_tokens, hidden) -> (num_tokens, hidden); `decode_rows` (the MLP's signature) changes
        nothing: every row of an expert runs the same matmul."""
        weights, experts = self.route(x)
        return self.experts(x, weights, experts)

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights a forward over `rows` tokens streams at most: the router, and the experts
        those rows can reach (rows * top_k, at most all of them), each weight in the form its kernel
        reads (stored groups, else float32), and their biases; an average expert's worth each."""
        experts = self.experts
        biases = sum(
            p[0].numel() * p.element_size() for p in (experts.gate_up_proj_bias, experts.down_proj_bias)
        )
        reached = min(experts.num_experts, rows * self.top_k)
        router = sum(p.numel() * p.element_size() for p in self.router.parameters())
        return router + experts.bytes_read(rows, self.top_k) + biases * reached


class GptOssDecoderLayer(nn.Module):
    """One gpt-oss layer over the paged cache; module names as in the checkpoint."""

    def __init__(
        self,
        config: ModelConfig,
        spec: GptOssSpec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = spec.layer_types[layer_idx]
        # float32 weights, transformers' order in low precision (its _keep_in_fp32_modules): GemmaRMSNorm
        self.input_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.self_attn = GptOssAttention(config, spec, layer_idx, dtype, device, ops)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.mlp = GptOssMoE(config, spec, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer's contract: h is the residual stream before the previous layer's output
        `residual` is added (None in layer 0; updated in place on the native path). Returns (h, this
        layer's MoE output)."""
        h, x = self.input_layernorm.add_and_norm(h, residual)
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.self_attn(x, cos, sin, kv_cache, layer_idx, meta)
        )
        return h, self.mlp(x, meta.num_decode)


def gpt_oss_layers(
    config: ModelConfig,
    spec: GptOssSpec,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: LayerOps = REFERENCE_OPS,
) -> nn.ModuleList:
    """Every layer of a gpt-oss model, in order (DecoderModel's `layers`; its final norm is a
    GemmaRMSNorm, float32 weight, for the same reason as the layers')."""
    assert len(spec.layer_types) == config.num_hidden_layers
    return nn.ModuleList(
        GptOssDecoderLayer(config, spec, i, dtype, device, ops) for i in range(config.num_hidden_layers)
    )
