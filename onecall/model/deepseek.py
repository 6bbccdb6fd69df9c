"""DeepSeek-V3 (and Kimi-K2, GLM-4.7-Flash: the `deepseek_v3` architecture): multi-head latent attention
(MLA) over a latent KV cache, and the grouped sigmoid-routed MoE, forward only.

Read against transformers' DeepseekV3ForCausalLM (models/deepseek_v3/modeling_deepseek_v3.py). Per layer,
Llama's two pre-norms; the attention and MLP differ:

| piece      | DeepSeek-V3                                                                                 |
|------------|---------------------------------------------------------------------------------------------|
| q          | q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank: per head [nope | rope]  |
| latent     | kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]; c = kv_a_layernorm(c) |
| K, V       | kv_b_proj(c) per head = [k_nope (qk_nope_head_dim) | v (v_head_dim)]; K = [k_nope | k_pe],   |
|            | k_pe one roped key shared by every head                                                     |
| RoPE       | on q's and k_pe's rope dims only; rope_interleave (default): pairs (x0, x1), ... rotated    |
|            | and written out as [evens | odds], as transformers does (q and k alike: dot products hold)  |
| scale      | qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn                         |
| router     | sigmoid(gate(x)) (float32); + e_score_correction_bias for the choice only: the best          |
|            | topk_group of n_group groups (scored by their top 2), then top k within them; weights the   |
|            | plain sigmoids, renormalised (norm_topk_prob), times routed_scaling_factor                  |
| MLP        | the first first_k_dense_replace layers dense (intermediate_size); then routed experts plus   |
|            | shared_experts (n_shared_experts x moe_intermediate_size wide), always on                   |

The cache (the design's point): a token keeps one latent row per layer, [c (normed) | k_pe (roped)],
kv_lora_rank + qk_rope_head_dim floats (576 for DeepSeek-V3: 1,152 bytes a layer in bfloat16, against
2 x 128 heads x 192 = 49,152 floats for the equivalent per-head K and V). The pool is the engine's
PagedKVCache unchanged: one KV head of head_dim = half the row (DeepseekSpec.cache_head_dim), K holding
the row's first half and V its second, so its bytes per token are the latent's (plus at most 3 pad
floats) and copy-on-write, block tables and prefix caching work as for any model.

Attention reads the latent rows of each sequence (its slots through AttentionMetadata, as the
reference backend gathers them) in one of two forms, both exact:
- decompressed (prefill chunks): K and V of every cached position through kv_b_proj, then per-head
  attention with a causal mask;
- absorbed (decode rows): kv_b_proj's K part folded into q (q_nope W_uk: a query over the latent) and
  its V part applied after the softmax (o = (p c) W_uv^T), so no per-head K or V is built.
`MLAttention.mode` forces either for every row (the tests hold them against each other).

No native or Triton kernel: softmax and products are torch's, per sequence. The MoE loop reads the hit
experts on the host; the engine then runs eager steps (it captures no CUDA graph for a MoE model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, LayerOps
from onecall.model import rope
from onecall.model.attention_metadata import AttentionMetadata, SeqSpan
from onecall.model.config import DeepseekSpec, ModelConfig
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import Linear, ModelPart, RMSNorm, RotaryEmbedding, apply_rope
from onecall.model.moe import Experts

MODES = ("auto", "decompressed", "absorbed")

# The projections the fast kernels replace (model/decoder.py PROJECTION_PARTS), each filled whole by its
# own checkpoint tensor: the query (plain or low-rank), the latent's down-projection, a dense layer's MLP
# and the MoE's shared expert. kv_b_proj stays a float32 weight: the absorbed decode folds it into the
# query and the output (einsums over its per-head blocks), not a projection of the step's rows.
DEEPSEEK_PROJECTION_PARTS = {
    name: (name,)
    for name in (
        "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
        "mlp.gate_proj", "mlp.up_proj",
        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
    )
}  # fmt: skip


def yarn_softmax_scale(config: ModelConfig, spec: DeepseekSpec) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the RoPE is yarn with mscale_all_dim
    (transformers' yarn_apply_mscale: MLA scales the non-rotary dims too)."""
    scale: float = spec.qk_head_dim**-0.5
    s = config.rope_scaling
    if s is not None and s.rope_type != "default" and s.mscale_all_dim:
        m = rope.yarn_mscale(s.factor, s.mscale_all_dim)
        scale *= m * m
    return scale


def rotary_table(
    config: ModelConfig, spec: DeepseekSpec, dtype: torch.dtype, device: torch.device | str
) -> RotaryEmbedding:
    """The cos/sin tables of the rope dims (qk_rope_head_dim wide), with the config's scaling."""
    return RotaryEmbedding(
        spec.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta, dtype, device,
        scaling=config.rope_scaling,
    )  # fmt: skip


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE as transformers' apply_rotary_pos_emb_interleave: pair (x[2i], x[2i+1]) rotated
    by angle i, written out as [all first | all second] of the pairs."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _sequence_rows(cache: torch.Tensor, s: SeqSpan, block_size: int) -> torch.Tensor:
    """(seq_len, ...): the sequence's rows of one cache layer, a view where its blocks are one run."""
    if s.kv_start >= 0:
        return cache[s.kv_start : s.kv_start + s.seq_len]
    if s.blocks is not None:
        by_block = cache.view(-1, block_size, *cache.shape[1:])
        return by_block.index_select(0, s.blocks).flatten(0, 1)[: s.seq_len]
    assert s.slots is not None, "metadata has no KV source for this sequence"
    return cache.index_select(0, s.slots)


class MLAttention(nn.Module):
    """Multi-head latent attention over the latent cache (the module docstring has the math)."""

    def __init__(
        self,
        config: ModelConfig,
        spec: DeepseekSpec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        h, bias, eps = config.hidden_size, config.attention_bias, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.rank = spec.kv_lora_rank
        self.interleave = spec.rope_interleave
        self.scale = yarn_softmax_scale(config, spec)
        self.mode = "auto"  # MODES: "auto" decodes absorbed and prefills decompressed
        q_out = self.num_heads * spec.qk_head_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if spec.q_lora_rank is None:
            self.q_proj = Linear(h, q_out, bias=False, dtype=dtype, device=device)
        else:
            self.q_a_proj = Linear(h, spec.q_lora_rank, bias=bias, dtype=dtype, device=device)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps, dtype, device)
            self.q_b_proj = Linear(spec.q_lora_rank, q_out, bias=False, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = Linear(h, spec.latent_width, bias=bias, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(self.rank, eps, dtype, device)
        self.kv_b_proj = Linear(
            self.rank, self.num_heads * (self.nope + self.v_dim), bias=False, dtype=dtype, device=device
        )
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias, dtype=dtype, device=device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_pairs(x, cos, sin) if self.interleave else apply_rope(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x (num_tokens, hidden) -> (num_tokens, hidden); writes the tokens' latent rows first."""
        n, rows = x.shape[0], meta.num_decode
        if self.q_proj is not None:
            q = self.q_proj(x, rows)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, rows)), rows)
        q = q.view(n, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split((self.nope, self.rope_dim), dim=-1)
        q_pe = self._rope(q_pe, cos, sin)
        c, k_pe = self.kv_a_proj_with_mqa(x, rows).split((self.rank, self.rope_dim), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self._rope(k_pe[:, None], cos, sin)[:, 0]), dim=-1)
        k_cache, v_cache = kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx]  # (slots, 1, half)
        half = k_cache.shape[-1]
        row = F.pad(latent, (0, 2 * half - latent.shape[-1]))
        k_cache.index_copy_(0, meta.slot_mapping, row[:, None, :half].to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, row[:, None, half:].to(v_cache.dtype))
        out = q.new_empty(n, self.num_heads, self.v_dim)
        for s in meta.seqs:
            lat = torch.cat(
                (_sequence_rows(k_cache, s, meta.block_size), _sequence_rows(v_cache, s, meta.block_size)),
                dim=-1,
            )[:, 0, : self.rank + self.rope_dim].to(q.dtype)  # (seq_len, rank + rope)
            qn, qp = q_nope[s.q_start : s.q_end], q_pe[s.q_start : s.q_end]
            absorbed = self.mode == "absorbed" or (self.mode == "auto" and s.query_len == 1)
            attend = self._absorbed if absorbed else self._decompressed
            out[s.q_start : s.q_end] = attend(qn, qp, lat[:, : self.rank], lat[:, self.rank :], s)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim), rows)

    def _softmax(self, scores: torch.Tensor, s: SeqSpan) -> torch.Tensor:
        """(heads, query_len, seq_len) scores -> float32 causal probabilities (query i at position
        seq_len - query_len + i)."""
        scores = scores.float() * self.scale
        if s.query_len > 1:
            q_pos = torch.arange(s.seq_len - s.query_len, s.seq_len, device=scores.device)[:, None]
            k_pos = torch.arange(s.seq_len, device=scores.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        return scores.softmax(dim=-1)

    def _decompressed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, s: SeqSpan
    ) -> torch.Tensor:
        """K, V of every position through kv_b_proj, then attention per head -> (query_len, heads, v)."""
        kv = F.linear(c, self.kv_b_proj.weight).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)  # (seq_len, heads, ...)
        scores = torch.einsum("qhd,khd->hqk", q_nope, k_nope) + torch.einsum("qhd,kd->hqk", q_pe, k_pe)
        probs = self._softmax(scores, s).to(v.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v)

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor, s: SeqSpan
    ) -> torch.Tensor:
        """The same attention over the latents: q_nope W_uk scores against c directly, (p c) W_uv^T after."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (heads, nope, rank), (heads, v, rank)
        q_lat = torch.einsum("qhd,hdr->qhr", q_nope, w_uk)
        scores = torch.einsum("qhr,kr->hqk", q_lat, c) + torch.einsum("qhd,kd->hqk", q_pe, k_pe)
        probs = self._softmax(scores, s).to(c.dtype)
        o_lat = torch.einsum("hqk,kr->qhr", probs, c)
        return torch.einsum("qhr,hvr->qhv", o_lat, w_uv)


class DeepseekMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense layer's MLP, and the shared experts."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return self.down_proj(
            F.silu(self.gate_proj(x, decode_rows)) * self.up_proj(x, decode_rows), decode_rows
        )


class DeepseekRouter(nn.Module):
    """transformers' DeepseekV3TopkRouter: float32 weight and e_score_correction_bias (module docstring)."""

    def __init__(self, config: ModelConfig, spec: DeepseekSpec, device: torch.device | str) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k, self.norm = moe.num_experts_per_tok, moe.norm_topk_prob
        self.n_group, self.topk_group, self.factor = spec.n_group, spec.topk_group, spec.routed_scaling_factor
        e = moe.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32, device=device))
        self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, hidden) -> weights (float32), expert ids, each (num_tokens, top_k)."""
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        n, e = choice.shape
        groups = choice.view(n, self.n_group, e // self.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)  # (n, n_group)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(n, e), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.factor, ids


class DeepseekMoE(nn.Module):
    """Routed experts plus the shared experts (checkpoint names: mlp.gate, mlp.experts, mlp.shared_experts)."""

    def __init__(
        self, config: ModelConfig, spec: DeepseekSpec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        h = config.hidden_size
        self.gate = DeepseekRouter(config, spec, device)
        # the routed experts are moe.Experts (SiLU-gated, [gate; up] stacked): a GGUF's run on the native
        # kernels in the file's own groups (loading/weights.py _use_stored_experts), like every MoE's
        self.experts = Experts(moe.num_experts, h, moe.moe_intermediate_size, dtype, device)
        self.shared_experts = DeepseekMLP(h, moe.shared_expert_intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x, decode_rows)

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights a forward over `rows` tokens streams at most: the router, the routed experts
        those rows can reach (moe.Experts.bytes_read), and the shared experts' parameters (a projection
        the fast kernels packed holds none: the caller counts it as it counts every packed projection)."""
        router = sum(p.numel() * p.element_size() for p in self.gate.parameters())
        shared = sum(p.numel() * p.element_size() for p in self.shared_experts.parameters())
        return router + self.experts.bytes_read(rows, self.gate.top_k) + shared


class DeepseekDecoderLayer(nn.Module):
    """h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))."""

    def __init__(
        self,
        config: ModelConfig,
        spec: DeepseekSpec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, eps, moe = config.hidden_size, config.rms_norm_eps, config.moe
        assert moe is not None
        self.input_layernorm = RMSNorm(h, eps, dtype, device, ops)
        self.self_attn = MLAttention(config, spec, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, ops)
        self.mlp: DeepseekMLP | DeepseekMoE = (
            DeepseekMoE(config, spec, dtype, device)
            if moe.sparse_layers[layer_idx]
            else DeepseekMLP(h, config.intermediate_size, dtype, device)
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h), meta.num_decode)


def deepseek_layers(
    config: ModelConfig, spec: DeepseekSpec, dtype: torch.dtype, device: torch.device | str, ops: LayerOps
) -> nn.ModuleList:
    return nn.ModuleList(
        DeepseekDecoderLayer(config, spec, i, dtype, device, ops) for i in range(config.num_hidden_layers)
    )


def deepseek_forward(
    model: ModelPart,
    input_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: PagedKVCache,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The `model.` part's forward: input_ids (num_tokens,) and the rope dims' (cos, sin) -> final-normed
    hidden states (num_tokens, hidden_size)."""
    h = model.embed_tokens(input_ids)
    for layer in model.layers:
        h = layer(h, cos, sin, kv_cache, meta)
    out: torch.Tensor = model.norm(h)
    return out


def set_mla_mode(model: nn.Module, mode: str) -> None:
    """Every MLA layer of `model` attends in `mode` (MODES): "decompressed" or "absorbed" for every row,
    or "auto" (decode rows absorbed, prefill chunks decompressed)."""
    assert mode in MODES, f"mode must be one of {MODES}"
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.mode = mode
