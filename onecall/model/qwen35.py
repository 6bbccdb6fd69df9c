"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (text): hybrid layers, Gated DeltaNet and gated full attention.

config.linear_attention.layer_types says which layers are which (three linear to one full in the
released models). Every layer is pre-norm, h += mixer(norm(h)); h += mlp(norm(h)), like DecoderLayer,
with a different token mixer per type:

| layer type         | token mixer                                           | its memory                         |
|--------------------|-------------------------------------------------------|------------------------------------|
| "full_attention"   | GatedAttention: Qwen3's attention (q/k norms, partial | K/V in the paged cache; its index  |
|                    | RoPE) with o_proj reading attn * sigmoid(gate_proj(x))| among the full-attention layers    |
| "linear_attention" | GatedDeltaNet: conv1d over q/k/v, the gated delta     | a fixed-size state per sequence in |
|                    | rule (model/delta_rule.py), a gated RMSNorm           | the LinearStateCache; its index    |
|                    |                                                       | among the linear layers            |

GatedDeltaNet, per token (transformers' Qwen3_5GatedDeltaNet):

    [qkv; z; b; a] = in_proj(x)              one fused projection (checkpoint: in_proj_qkv, _z, _b, _a;
                                             Qwen3-Next's per-key-head in_proj_qkvz / in_proj_ba are
                                             reordered into these by the loader)
    qkv  = silu(causal depthwise conv1d(qkv))  width linear_conv_kernel_dim, over the sequence
    q, k, v = split(qkv)                     q, k: linear_num_key_heads heads; v: linear_num_value_heads
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)      per value head, g <= 0
    o    = gated delta rule(l2norm(q), l2norm(k), v, g, beta)        (each key head serves ratio
                                                                      consecutive value heads)
    out  = out_proj(rms_norm(o) * norm.weight * silu(z))             per value head

Norms: input_layernorm, post_attention_layernorm, the final norm and the attention's q/k norms are
zero-centred, (1 + w): the loader folds the + 1 in (float32, model/gemma.py's GemmaRMSNorm runs them,
and the fused add+RMSNorm and q/k-norm kernels take them as plain RMSNorm). The gated norm
(linear_attn.norm) is NOT: its checkpoint weight is the scale itself (transformers initialises it to
ones and multiplies by it), so it is loaded as it is.

The attention's q_proj in the checkpoint holds q and the output gate interleaved per head ([q_h; gate_h]
rows, head after head); the loader splits it into q (fused into qkv_proj with k and v) and gate_proj.
Partial rotary (partial_rotary_factor 0.25) runs as full-width RoPE on permuted q/k rows, as for Phi-3
(model/rope.py). Text positions are the same on all three of transformers' multimodal RoPE axes, where
the mrope sections reduce to plain RoPE: one table serves every full-attention layer.

The state of a sequence (LinearStateCache, AttentionMetadata.state_slots): a DeltaNet layer starts a
sequence from zeros when its first new position is 0, else from its slot, and writes back the conv's
last kernel - 1 inputs and the recurrent state after the sequence's last new token. Decode rows
(query_len 1) run as one batch: on the layer's ops (LayerOps.delta_decode_rows: conv, gates, the rule
and the gated norm in one call, the states read and written in place by slot) where they take it, else
in torch (slots gathered, one recurrent step, scattered back); prompt chunks one sequence at a time, in
the chunked form.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, DeltaNetWeights, LayerOps
from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import AttentionMetadata, SeqSpan
from onecall.model.config import LINEAR, LinearAttentionSpec, ModelConfig
from onecall.model.delta_rule import L2_EPS, chunked_gated_delta_rule, gated_delta_step_, prepare_qk, widen
from onecall.model.gemma import GemmaRMSNorm
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP, Attention, Linear
from onecall.model.moe import SparseMoE
from onecall.model.state_cache import LinearStateCache

# Our projections of a hybrid layer and the checkpoint tensors each is made of, in row order (after the
# loader's rewrites: q_proj split into q and gate_proj, Qwen3-Next's in_proj_qkvz / in_proj_ba reordered).
HYBRID_PROJECTION_PARTS = {
    "self_attn.gate_proj": ("self_attn.gate_proj",),
    "linear_attn.in_proj": (
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
    ),
    "linear_attn.out_proj": ("linear_attn.out_proj",),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
}


def hybrid_part_rows(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Rows of the hybrid layers' fused projections that each checkpoint part fills."""
    spec = config.linear_attention
    assert spec is not None
    conv, value, heads = spec.conv_dim, spec.value_dim, spec.linear_num_value_heads
    rows = {
        "linear_attn.in_proj_qkv": (0, conv),
        "linear_attn.in_proj_z": (conv, conv + value),
        "linear_attn.in_proj_b": (conv + value, conv + value + heads),
        "linear_attn.in_proj_a": (conv + value + heads, conv + value + 2 * heads),
    }
    shared = config.moe.shared_expert_intermediate_size if config.moe is not None else 0
    if shared:
        rows["mlp.shared_expert.gate_proj"] = (0, shared)
        rows["mlp.shared_expert.up_proj"] = (shared, 2 * shared)
    return rows


class RMSNormGated(nn.Module):
    """rms_norm(x) * weight * silu(z) over each value head (transformers' Qwen3_5RMSNormGated): normalised
    in float32, cast back and scaled in the model dtype, then gated in float32. A plain weight (no 1 + w)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(widen(x), self.weight.shape, None, self.eps).to(x.dtype) * self.weight
        return (y * F.silu(widen(z))).to(x.dtype)


class CausalConv1d(nn.Module):
    """The depthwise causal conv over q/k/v channels, weight (channels, 1, kernel) as the checkpoint's
    conv1d (no bias), followed by SiLU. Its state is the last kernel - 1 inputs before a chunk."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.width = kernel - 1
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype, device=device))

    def chunk(self, x: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's chunk x (tokens, channels) after `before` (channels, kernel - 1) -> (silu(conv)
        (tokens, channels), the state after the chunk: its last kernel - 1 inputs, the earlier ones
        from `before` when the chunk is shorter)."""
        window = torch.cat((before.to(x.dtype), x.t()), dim=1)  # (channels, kernel - 1 + tokens)
        out = F.conv1d(window.unsqueeze(0), self.weight, groups=self.weight.shape[0])[0]  # (channels, tokens)
        return F.silu(out).t(), window[:, window.shape[1] - self.width :]

    def step(self, x: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of n sequences, x (n, channels) after `before` (n, channels, kernel - 1) ->
        (silu(conv) (n, channels), each sequence's state after it)."""
        window = torch.cat((before.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # (n, channels, kernel)
        out = (window * self.weight.squeeze(1)).sum(dim=-1)
        return F.silu(out), window[..., 1:]


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (the module docstring's formulas) over the step's flat batch; its state
    lives in the LinearStateCache under its index among the model's linear layers."""

    def __init__(
        self,
        config: ModelConfig,
        spec: LinearAttentionSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.num_k_heads, self.num_v_heads = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.k_head_dim, self.v_head_dim = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = spec.key_dim, spec.value_dim, spec.conv_dim
        h, heads = config.hidden_size, self.num_v_heads
        # rows: [qkv (conv_dim); z (value_dim); b (v heads); a (v heads)]
        self.in_proj = Linear(
            h, self.conv_dim + self.value_dim + 2 * heads, bias=False, dtype=dtype, device=device
        )
        self.conv1d = CausalConv1d(self.conv_dim, spec.linear_conv_kernel_dim, dtype, device)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=dtype, device=device))
        self.norm = RMSNormGated(self.v_head_dim, config.rms_norm_eps, dtype, device)
        self.out_proj = Linear(self.value_dim, h, bias=False, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, state: LinearStateCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x (num_tokens, hidden) -> (num_tokens, hidden); reads and writes the slots meta.state_slots names
        in layer `layer` of `state`."""
        assert meta.state_slots is not None, "a hybrid model's step needs AttentionMetadata.state_slots"
        n = x.shape[0]
        proj = self.in_proj(x, meta.num_decode)
        decode = [i for i, s in enumerate(meta.seqs) if s.query_len == 1]
        rows = [meta.seqs[i].q_start for i in decode]
        snapshots = {i: (p, slot) for i, p, slot in meta.state_snapshots or ()}
        # 1. the decode rows on the layer's ops (states in place): their gated norm's output, or None
        y_decode = self._decode_rows_on_ops(decode, rows, proj, state, layer, meta) if decode else None
        if y_decode is not None and rows == list(range(n)):  # it took every row of the step
            y = y_decode
        else:  # 2. in torch, every row step 1 did not take
            y = self._torch_rows(proj, [] if y_decode is not None else decode, state, layer, meta, snapshots)
            if y_decode is not None:
                y[rows] = y_decode.to(y.dtype)
        for i in decode:  # a one-token chunk's snapshot is the state after it
            if i in snapshots:
                state.copy_layer(layer, [int(meta.state_slots[i])], [snapshots[i][1]])
        return self.out_proj(y, meta.num_decode)

    def _torch_rows(
        self,
        proj: torch.Tensor,
        decode: list[int],
        state: LinearStateCache,
        layer: int,
        meta: AttentionMetadata,
        snapshots: dict[int, tuple[int, int]],
    ) -> torch.Tensor:
        """The torch path over the in_proj rows `proj`: the one-token sequences `decode` (one batch) and
        every prompt chunk -> the gated norm's output (num_tokens, value_dim); rows of neither are zeros."""
        assert meta.state_slots is not None
        n, heads = proj.shape[0], self.num_v_heads
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, heads, heads], dim=-1)
        beta = b.sigmoid()  # (num_tokens, v heads)
        g = -widen(self.A_log).exp() * F.softplus(widen(a) + self.dt_bias)  # (num_tokens, v heads), float32
        core = proj.new_zeros(n, heads, self.v_head_dim)
        if decode:
            self._decode_rows(decode, qkv, g, beta, core, state, layer, meta)
        for i, s in enumerate(meta.seqs):
            if s.query_len > 1:
                self._prompt_chunk(i, s, qkv, g, beta, core, state, layer, meta.state_slots, snapshots.get(i))
        return self.norm(core, z.reshape(n, heads, self.v_head_dim)).reshape(n, self.value_dim)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., conv_dim) -> prepared q, k (..., v heads, k_dim) and v (..., v heads, v_dim)."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        q, k = prepare_qk(
            q.reshape(*lead, self.num_k_heads, self.k_head_dim),
            k.reshape(*lead, self.num_k_heads, self.k_head_dim),
            self.num_v_heads,
        )
        return q, k, v.reshape(*lead, self.num_v_heads, self.v_head_dim)

    def _decode_rows_on_ops(
        self,
        decode: list[int],
        rows: list[int],
        proj: torch.Tensor,
        state: LinearStateCache,
        layer: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Every one-token sequence at once on LayerOps.delta_decode_rows (its states read and written in
        place in their slots): the gated norm's output (len(decode), value_dim); None where the ops
        decline (nothing written: the torch path, _decode_rows, runs them)."""
        assert meta.state_slots is not None
        n = len(decode)
        device = proj.device
        prefix = rows == list(range(n))  # the engine packs decode rows first
        slots = (
            meta.state_slots[:n]
            if decode == list(range(n))
            else meta.state_slots[torch.tensor(decode, dtype=torch.int64, device=device)]
        )
        fresh_rows = [meta.seqs[i].seq_len <= 1 for i in decode]  # position 0: zero states
        fresh = torch.tensor(fresh_rows, dtype=torch.bool) if any(fresh_rows) else None
        weights = DeltaNetWeights(
            self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps, L2_EPS,
            self.num_k_heads, self.k_head_dim,
        )  # fmt: skip
        proj_rows = proj[:n] if prefix else proj[torch.tensor(rows, dtype=torch.int64, device=device)]
        return self.ops.delta_decode_rows(
            proj_rows, weights, slots, fresh, state.conv[layer], state.recurrent[layer]
        )

    def _decode_rows(
        self,
        decode: list[int],
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
        state: LinearStateCache,
        layer: int,
        meta: AttentionMetadata,
    ) -> None:
        """Every one-token sequence at once: gather their states, one conv step and one recurrent
        step, scatter the states back. A sequence whose one token is its position 0 starts from zeros."""
        assert meta.state_slots is not None
        device = qkv.device
        row_list = [meta.seqs[i].q_start for i in decode]
        rows = torch.tensor(row_list, dtype=torch.int64, device=device)
        slots = meta.state_slots[torch.tensor(decode, dtype=torch.int64, device=device)]
        fresh = [j for j, i in enumerate(decode) if meta.seqs[i].seq_len <= 1]  # known on the host
        conv_cache, recurrent_cache = state.conv[layer], state.recurrent[layer]
        before = conv_cache.index_select(0, slots)  # (n, conv_dim, kernel - 1): gathered copies
        s = widen(recurrent_cache.index_select(0, slots))  # (n, heads, k_dim, v_dim)
        if fresh:
            before[fresh] = 0
            s[fresh] = 0
        prefix = row_list == list(range(len(row_list)))  # the engine packs decode rows first
        n = len(row_list)
        mixed, conv_after = self.conv1d.step(qkv[:n] if prefix else qkv[rows], before)
        q, k, v = self._split_heads(mixed)  # (n, heads, dim)
        g_rows, beta_rows = (g[:n], beta[:n]) if prefix else (g[rows], beta[rows])
        o = gated_delta_step_(q, k, v, g_rows, beta_rows, s)  # s updated in place
        conv_cache.index_copy_(0, slots, conv_after.to(conv_cache.dtype))
        recurrent_cache.index_copy_(0, slots, s.to(recurrent_cache.dtype))
        core[rows] = o.to(core.dtype)

    def _prompt_chunk(
        self,
        i: int,
        seq: SeqSpan,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        core: torch.Tensor,
        state: LinearStateCache,
        layer: int,
        state_slots: torch.Tensor,
        snapshot: tuple[int, int] | None = None,
    ) -> None:
        """One sequence's chunk of more than one token, in the chunked form, from its slot's state (zeros
        when the chunk starts at position 0); the state after its last token back into the slot.
        `snapshot` (position p, slot): also the state after the sequence's first p tokens into that slot,
        the chunk run in two parts split there (the delta rule carries its state across any split)."""
        rows = slice(seq.q_start, seq.q_end)
        slot = state_slots[i : i + 1]
        conv_cache, recurrent_cache = state.conv[layer], state.recurrent[layer]
        first = seq.seq_len - seq.query_len  # its first new position (0: it starts from zeros)
        before = conv_cache[slot][0]
        s0 = recurrent_cache[slot]  # (1, heads, k_dim, v_dim)
        if first == 0:
            before, s0 = torch.zeros_like(before), torch.zeros_like(s0)
        split = seq.query_len if snapshot is None else snapshot[0] - first
        outs = []
        for part in (slice(seq.q_start, seq.q_start + split), slice(seq.q_start + split, seq.q_end)):
            if part.stop == part.start:
                continue
            mixed, before = self.conv1d.chunk(qkv[part], before)
            q, k, v = self._split_heads(mixed)  # (tokens, heads, dim)
            o, s0 = chunked_gated_delta_rule(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                g[part].unsqueeze(0),
                beta[part].unsqueeze(0),
                s0,
            )
            outs.append(o[0])
            if snapshot is not None and part.stop == seq.q_start + split:  # the state after p tokens
                conv_cache[snapshot[1]] = before.to(conv_cache.dtype)
                recurrent_cache[snapshot[1]] = s0[0]
        conv_cache[slot] = before.unsqueeze(0).to(conv_cache.dtype)
        recurrent_cache[slot] = s0
        core[rows] = torch.cat(outs).to(core.dtype)


class GatedAttention(Attention):
    """Qwen3.5's full attention: Attention with (1 + w) q/k norms and an output gate,
    o_proj(attn * sigmoid(gate_proj(x))), one gate value per head and dimension."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__(config, dtype, device, ops)
        eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, device, ops)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps, device, ops)
        q_size = self.num_heads * self.head_dim
        self.gate_proj = Linear(config.hidden_size, q_size, bias=False, dtype=dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention.forward's q/k/v path (fused q/k norms + RoPE + K/V write where the ops take it),
        the gate before o_proj. `layer_idx`: this layer's index in the paged cache."""
        n = x.shape[0]
        gate = self.gate_proj(x, meta.num_decode)  # (num_tokens, heads * head_dim)
        qkv_flat = self.qkv_proj(x, meta.num_decode)
        fusable, qk_norm = self.fused_qk_norm(qkv_flat.dtype)
        if fusable and self.ops.rope_store(
            qkv_flat, self.num_heads, self.num_kv_heads, cos.squeeze(1), sin.squeeze(1),
            meta.slot_mapping, kv_cache.k[layer_idx], kv_cache.v[layer_idx], qk_norm,
        ):  # fmt: skip
            q = qkv_flat.view(n, -1, self.head_dim)[:, : self.num_heads]
            o = paged_attention(q, None, None, kv_cache, layer_idx, meta, self.scale, **self._options())
        else:
            q, k, v = self._rotated_heads(qkv_flat, cos, sin)
            o = paged_attention(q, k, v, kv_cache, layer_idx, meta, self.scale, **self._options())
        o = o.reshape(n, self.num_heads * self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(o, meta.num_decode)


class HybridDecoderLayer(nn.Module):
    """One layer of a hybrid model, module names as in the checkpoint: `linear_attn` or `self_attn` (the
    other one None), the MLP (dense, or sparse MoE with a shared expert) and two (1 + w) norms."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        spec = config.linear_attention
        assert spec is not None, "a hybrid layer needs config.linear_attention"
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = spec.layer_types[layer_idx] == LINEAR
        # index in the LinearStateCache (linear layers) or the paged KV cache (full-attention layers)
        self.cache_index = spec.cache_index(layer_idx)
        self.input_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.linear_attn = GatedDeltaNet(config, spec, dtype, device, ops) if self.is_linear else None
        self.self_attn = None if self.is_linear else GatedAttention(config, dtype, device, ops)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.mlp = self._mlp(config, layer_idx, dtype, device, ops)

    @staticmethod
    def _mlp(
        config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str, ops: LayerOps
    ) -> MLP | SparseMoE:
        """The dense MLP (Qwen3.5; Qwen3-Next's mlp_only_layers), else the sparse MoE with its shared
        expert, an MLP of shared_expert_intermediate_size (Qwen3-Next, Qwen3.5-MoE)."""
        moe = config.moe
        if moe is None or not moe.sparse_layers[layer_idx]:
            return MLP(config, dtype, device, ops)
        shared = None
        if moe.shared_expert_intermediate_size:
            wide = dataclasses.replace(config, intermediate_size=moe.shared_expert_intermediate_size)
            shared = MLP(wide, dtype, device, ops)
        return SparseMoE(
            config.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.num_experts_per_tok,
            moe.norm_topk_prob, dtype, device, shared_expert=shared,
        )  # fmt: skip

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
        """DecoderLayer's contract (h, and the previous layer's MLP output `residual` to add first).
        `layer_idx` (the layer's index in the model) is not used: the caches are indexed by
        self.cache_index. The linear layers' states are kv_cache.state."""
        h, x = self.input_layernorm.add_and_norm(h, residual)
        if self.linear_attn is not None:
            assert kv_cache.state is not None, "a hybrid model needs PagedKVCache.state (a LinearStateCache)"
            mixed = self.linear_attn(x, kv_cache.state, self.cache_index, meta)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(x, cos, sin, kv_cache, self.cache_index, meta)
        h, x = self.post_attention_layernorm.add_and_norm(h, mixed)
        return h, self.mlp(x, meta.num_decode)


def hybrid_layers(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, ops: LayerOps = REFERENCE_OPS
) -> nn.ModuleList:
    """Every layer of a hybrid model, in order (DecoderModel's `layers`)."""
    return nn.ModuleList(
        HybridDecoderLayer(config, i, dtype, device, ops) for i in range(config.num_hidden_layers)
    )
