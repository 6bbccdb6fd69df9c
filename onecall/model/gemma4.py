"""Gemma 4 (text): its layers and model part over the paged KV cache, forward only.

Read against transformers' Gemma4TextModel / Gemma4TextDecoderLayer (models/gemma4/modeling_gemma4.py).
Per layer, Gemma 2/3's four norms, then two Gemma 4 additions:

    h = h + post_attention_layernorm(attn(input_layernorm(h)))
    m = mlp(pre_feedforward_layernorm(h))
    MoE block (26B-A4B):  m = post_feedforward_layernorm_1(m)
                              + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h)), routed on h)
    h = h + post_feedforward_layernorm(m)
    per-layer input (E2B/E4B): h = h + post_per_layer_input_norm(per_layer_projection(
                                   gelu_tanh(per_layer_input_gate(h)) * per_layer_input[layer]))
    h = h * layer_scalar

| piece               | Gemma 4                                                                          |
|---------------------|----------------------------------------------------------------------------------|
| norms               | RMSNorm times w (not Gemma 2/3's 1 + w: nothing to fold on load), float32 weight |
| attention           | q_norm, k_norm (weighted), v_norm (no weight) per head; scale 1.0, no soft-cap   |
| global layers       | their own head_dim (global_head_dim) and KV heads; attention_k_eq_v: no v_proj,  |
|                     | V is K's projection (before k_norm and RoPE), then v_norm                        |
| RoPE                | per layer type: sliding rope_theta (10k), global "proportional": the first      |
|                     | proportion of each head's pairs rotated at theta^(-2i/head_dim), the rest cos 1  |
| KV sharing          | the last num_kv_shared_layers layers compute no K/V: each attends over the cache |
|                     | of the last earlier layer of its type, and holds no cache layer of its own       |
| per-layer inputs    | embed_tokens_per_layer(ids) * sqrt(p) and norm(per_layer_model_projection(e) /   |
|                     | sqrt(hidden)), summed, / sqrt(2): one p-wide vector per layer and token          |
| MLP                 | gelu_tanh gated; 2 x intermediate_size on the KV-sharing layers (double-wide)    |
| logits              | tied or not, final_logit_softcapping if set                                      |

The KV cache: the pool has one row width for every layer (ModelConfig.num_key_value_heads x head_dim =
Gemma4Spec.cache_width, the widest layer's). A layer views its cache layer as (num_slots, cache_width //
its head_dim, its head_dim), contiguous, and stores each of its KV heads kv_repeat times (a KV head
repeated is attended exactly as the one head: GQA only reads it for more query heads). So a narrower
layer costs repeated writes and reads, never a strided cache: the native and Triton attention kernels
and the engine's whole-row copy-on-write work unchanged.

Projections are transformers' separate Linear modules under their checkpoint names (no fused qkv or
gate_up: a layer's shapes depend on its type), loaded by name; the fast path may pack each of them
(GEMMA4_PROJECTION_PARTS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, LayerOps
from onecall.model import rope
from onecall.model.attention import attend_cache_layer
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.config import GLOBAL, SLIDING, Gemma4Spec, ModelConfig
from onecall.model.gemma import GemmaRMSNorm, GemmaRotary, embed_scale
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import Linear, ModelPart, RotaryEmbedding, apply_rope

# Gemma 4's projections (each one checkpoint tensor, under its own name), for DecoderLM.projections.
GEMMA4_PROJECTION_PARTS = {
    name: (name,)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
                 "per_layer_input_gate", "per_layer_projection")  # the last two: the layer's own (E2B-style)
}  # fmt: skip


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # hidden_activation "gelu_pytorch_tanh"


def _unit_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (v_norm, the router's norm), in float32 like transformers."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Gemma4Table(RotaryEmbedding):
    """One layer type's cos/sin table: transformers' "proportional" RoPE (the default type is its
    proportion 1, factor 1). inv_freq_i = theta^(-2i/head_dim) / factor for the first
    int(proportion * head_dim // 2) pairs, 0 (cos 1, sin 0: not rotated) for the rest."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        proportion: float,
        factor: float,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        nn.Module.__init__(self)
        angles = int(proportion * head_dim // 2)
        inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        cos, sin = rope.cos_sin_tables(inv_freq / factor, 1.0, max_positions, head_dim)
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)


class Gemma4Rotary(GemmaRotary):
    """GemmaRotary's lookup over Gemma 4's two tables (global: table 0, sliding: table 1)."""

    def __init__(
        self, config: ModelConfig, spec: Gemma4Spec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        nn.Module.__init__(self)
        n = config.max_position_embeddings
        self.tables = nn.ModuleList([
            Gemma4Table(spec.global_head_dim, n, spec.global_rope_theta, spec.global_rope_proportion,
                        spec.global_rope_factor, dtype, device),
            Gemma4Table(spec.sliding_head_dim, n, spec.sliding_rope_theta, 1.0, 1.0, dtype, device),
        ])  # fmt: skip
        self.layer_table = [1 if t == SLIDING else 0 for t in spec.layer_types]


class Gemma4Attention(nn.Module):
    """One layer's attention: its own head shape, q/k/v norms, K = V on global layers where configured,
    and the cache layer it reads (and writes, unless it shares an earlier layer's K/V)."""

    def __init__(
        self,
        config: ModelConfig,
        spec: Gemma4Spec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        h, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.head_dim = spec.head_dim(layer_idx)
        self.num_kv_heads = spec.kv_heads(layer_idx)
        self.kv_repeat = spec.kv_repeat(layer_idx)
        self.cache_layer = spec.cache_layer(layer_idx)
        self.writes = self.cache_layer == layer_idx  # False: a KV-sharing layer, no K/V of its own
        self.sliding_window = spec.sliding_window if spec.layer_types[layer_idx] == SLIDING else None
        self.eps = eps
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(h, q_size, bias=bias, dtype=dtype, device=device)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, device)
        self.k_proj: Linear | None = None
        self.v_proj: Linear | None = None
        self.k_norm: GemmaRMSNorm | None = None
        if self.writes:
            self.k_proj = Linear(h, kv_size, bias=bias, dtype=dtype, device=device)
            k_eq_v = spec.attention_k_eq_v and spec.layer_types[layer_idx] == GLOBAL
            if not k_eq_v:
                self.v_proj = Linear(h, kv_size, bias=bias, dtype=dtype, device=device)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps, device)
        self.o_proj = Linear(q_size, h, bias=bias, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n, rows = x.shape[0], meta.num_decode
        q = apply_rope(self.q_norm(self.q_proj(x, rows).view(n, self.num_heads, self.head_dim)), cos, sin)
        k = v = None
        if self.k_proj is not None and self.k_norm is not None:
            k_raw = self.k_proj(x, rows).view(n, self.num_kv_heads, self.head_dim)
            v_raw = (
                k_raw
                if self.v_proj is None
                else self.v_proj(x, rows).view(n, self.num_kv_heads, self.head_dim)
            )
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = _unit_norm(v_raw, self.eps)
            if self.kv_repeat > 1:  # fill the cache row: each KV head stored kv_repeat times
                k = k.repeat_interleave(self.kv_repeat, dim=1)
                v = v.repeat_interleave(self.kv_repeat, dim=1)
        slots = kv_cache.k.shape[1]
        k_cache = kv_cache.k[self.cache_layer].view(slots, -1, self.head_dim)
        v_cache = kv_cache.v[self.cache_layer].view(slots, -1, self.head_dim)
        o = attend_cache_layer(q, k, v, k_cache, v_cache, meta, 1.0, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim), rows)


class Gemma4MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), transformers' three Linear modules."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return self.down_proj(
            _gelu(self.gate_proj(x, decode_rows)) * self.up_proj(x, decode_rows), decode_rows
        )


class Gemma4Router(nn.Module):
    """top_k of softmax(proj(norm(h) * scale / sqrt(hidden))) (float32), renormalised to sum 1, each
    then times its expert's per_expert_scale."""

    def __init__(
        self, config: ModelConfig, spec: Gemma4Spec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.eps, self.top_k, self.root = config.rms_norm_eps, spec.top_k_experts, h**-0.5
        self.proj = Linear(h, spec.num_experts, bias=False, dtype=dtype, device=device)
        self.scale = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts, dtype=dtype, device=device))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, hidden) -> weights, expert ids, each (num_tokens, top_k)."""
        x = _unit_norm(h, self.eps) * self.scale * self.root
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """The experts, stacked as transformers holds them: gate_up_proj (E, 2I, H) rows [gate; up],
    down_proj (E, H, I); each token through its top k, gelu_tanh gated, weighted and summed."""

    def __init__(
        self, config: ModelConfig, spec: Gemma4Spec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        e, h, i = spec.num_experts, config.hidden_size, spec.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, weights, ids)  # a CUDA graph cannot read the hit experts
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():  # the experts some token picked (a host sync)
            token, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(_gelu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def every_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """forward's sum without a host sync: every expert over every token, each weighted by its
        routing weight (0 where the token did not pick it). What a CUDA graph captures."""
        dense = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)  # (num_tokens, num_experts)
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(_gelu(gate) * up, self.down_proj[expert]) * dense[:, expert, None]
            out += y.to(out.dtype)
        return out


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer over the paged cache; module names as in the checkpoint."""

    def __init__(
        self,
        config: ModelConfig,
        spec: Gemma4Spec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.self_attn = Gemma4Attention(config, spec, layer_idx, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.mlp = Gemma4MLP(h, spec.intermediate_size(layer_idx, config.intermediate_size), dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.router: Gemma4Router | None = None
        self.experts: Gemma4Experts | None = None
        if spec.num_experts:
            self.router = Gemma4Router(config, spec, dtype, device)
            self.experts = Gemma4Experts(config, spec, dtype, device)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(h, eps, device, ops)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(h, eps, device, ops)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(h, eps, device, ops)
        self.per_layer_input_gate: Linear | None = None
        p = spec.hidden_size_per_layer_input
        if p:
            self.per_layer_input_gate = Linear(h, p, bias=False, dtype=dtype, device=device)
            self.per_layer_projection = Linear(p, h, bias=False, dtype=dtype, device=device)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps, device, ops)
        self.layer_scalar = nn.Parameter(
            torch.ones(1, dtype=dtype, device=device)
        )  # a buffer in transformers

    def forward(
        self,
        h: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """h (num_tokens, hidden), this layer's per-layer input (num_tokens, p) or None -> the new h."""
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        h = h + self.post_attention_layernorm(attn)
        m = self.mlp(self.pre_feedforward_layernorm(h), meta.num_decode)
        if self.router is not None and self.experts is not None:
            weights, ids = self.router(h)  # routed on the residual stream, not the MLP's input
            moe = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(moe)
        h = h + self.post_feedforward_layernorm(m)
        if self.per_layer_input_gate is not None and per_layer_input is not None:
            g = _gelu(self.per_layer_input_gate(h, meta.num_decode)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g, meta.num_decode))
        return h * self.layer_scalar


def gemma4_layers(
    config: ModelConfig, spec: Gemma4Spec, dtype: torch.dtype, device: torch.device | str, ops: LayerOps
) -> nn.ModuleList:
    return nn.ModuleList(
        Gemma4DecoderLayer(config, spec, i, dtype, device, ops) for i in range(config.num_hidden_layers)
    )


def add_per_layer_inputs(
    model: nn.Module, config: ModelConfig, spec: Gemma4Spec, dtype: torch.dtype, device: torch.device | str
) -> None:
    """The per-layer embeddings' modules on the `model.` part, under their checkpoint names (none when
    hidden_size_per_layer_input is 0)."""
    p = spec.hidden_size_per_layer_input
    if not p:
        return
    width = config.num_hidden_layers * p
    weight = torch.empty(spec.vocab_size_per_layer_input, width, dtype=dtype, device=device)
    model.embed_tokens_per_layer = nn.Embedding(spec.vocab_size_per_layer_input, width, _weight=weight)
    model.per_layer_model_projection = Linear(
        config.hidden_size, width, bias=False, dtype=dtype, device=device
    )
    model.per_layer_projection_norm = GemmaRMSNorm(p, config.rms_norm_eps, device)


def gemma4_forward(
    model: ModelPart,
    input_ids: torch.Tensor,
    ropes: list[tuple[torch.Tensor, torch.Tensor]],
    kv_cache: PagedKVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The `model.` part's forward (DecoderModel with Gemma 4 layers): input_ids (num_tokens,) and
    Gemma4Rotary's per-layer (cos, sin) -> final-normed hidden states (num_tokens, hidden_size)."""
    e = model.embed_tokens(input_ids)
    e = e * embed_scale(e.shape[-1], e.dtype)
    per_layer: torch.Tensor | None = None
    table = getattr(model, "embed_tokens_per_layer", None)  # add_per_layer_inputs' modules, if any
    if table is not None:
        n, num_layers = input_ids.shape[0], len(model.layers)
        tokens = table(input_ids)
        tokens = (tokens * embed_scale(tokens.shape[-1] // num_layers, tokens.dtype)).view(n, num_layers, -1)
        context = getattr(model, "per_layer_model_projection")(e) * e.shape[-1] ** -0.5  # noqa: B009
        context = getattr(model, "per_layer_projection_norm")(context.view(n, num_layers, -1))  # noqa: B009
        per_layer = (context + tokens) * 2.0**-0.5
    h = e
    for i, layer in enumerate(model.layers):
        cos, sin = ropes[i]
        h = layer(h, None if per_layer is None else per_layer[:, i], cos, sin, kv_cache, meta)
    out: torch.Tensor = model.norm(h)
    return out
