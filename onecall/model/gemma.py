"""Gemma 2 and Gemma 3 (text): what they add to the Llama decoder of model/layers.py, forward only.

Per layer (transformers' Gemma2DecoderLayer / Gemma3DecoderLayer), four norms instead of two, the
attention and MLP outputs normalised before they join the residual stream:

    h = h + post_attention_layernorm(attn(input_layernorm(h)))
    h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

and around the layers: embeddings times sqrt(hidden_size) (the factor cast to the embedding dtype
first, as transformers does: 55.4256 becomes 55.5 in bfloat16), a final norm, and the logits
soft-capped, cap * tanh(logits / cap) (final_logit_softcapping; Gemma 3 configs leave it None).

| piece                 | Gemma 2                            | Gemma 3                                       |
|-----------------------|------------------------------------|-----------------------------------------------|
| norms                 | RMSNorm scaled by (1 + weight)     | the same, also per-head q/k norms             |
| MLP                   | gate/up/down, gelu (tanh approx.)  | the same                                      |
| attention scale       | query_pre_attn_scalar ** -0.5      | the same                                      |
| attention soft-cap    | attn_logit_softcapping (50.0)      | none (transformers ignores the key)           |
| sliding layers        | every other one (layer_types)      | layer_types (5 sliding : 1 global)            |
| RoPE                  | rope_theta, every layer            | sliding: rope_local_base_freq, no scaling;    |
|                       |                                    | global: rope_theta and its (linear) scaling   |

The (1 + weight) norms: the `+ 1` is folded into the weight when it is loaded, so every Gemma norm
is our plain RMSNorm computing norm(x) * weight, and the native add_rms_norm and the native q/k norm
in rope_store (kernels/cpu/ops.py) run it unchanged in float32. The loader MUST store checkpoint_norm_weight(w) =
1 + w (in float32) for every `*norm.weight` of a Hugging Face Gemma checkpoint. llama.cpp's GGUF
converter stores 1 + w itself; formats/gguf.py hands the loader w back (in float64, exactly), so a GGUF
loads the same way and its norms are not shifted twice. The folded weight is held in float32 whatever
the model dtype: 1 + w computed and kept in float32 is exactly transformers'
`1.0 + self.weight.float()`, where a bfloat16 copy would round every channel's scale once more.

Per-layer RoPE: layers of different types rotate with different tables (Gemma 3), so GemmaRotary
holds one layers.RotaryEmbedding per distinct table (model/rope.py's formulas, any scaling
ModelConfig accepts), looks each up once per step and hands the decoder loop one (cos, sin) per
layer; layers of the same type share the same tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, LayerOps
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.config import SLIDING, GemmaSpec, ModelConfig
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding


def checkpoint_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Hugging Face Gemma `*norm.weight` w -> the weight our RMSNorm holds: 1 + w in float32 (for the
    loader: every Gemma norm, including q_norm / k_norm and the final norm). A float64 w is what the GGUF
    reader yields for a norm the converter stored as x = 1 + w (x - 1, exact in float64): adding 1 back
    in float64 and rounding gives x bit for bit, so a GGUF's norms are never rounded twice."""
    if weight.dtype == torch.float64:
        return (1.0 + weight).float()
    return 1.0 + weight.float()


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose (folded, 1 + w) weight is float32 whatever the model dtype. In low precision it
    scales before casting back, transformers' Gemma order ((x_normed * w).to(dtype)), which the fused
    kernels do not: they take it in float32 only, where it is RMSNorm itself."""

    def __init__(
        self, dim: int, eps: float, device: torch.device | str, ops: LayerOps = REFERENCE_OPS
    ) -> None:
        super().__init__(dim, eps, torch.float32, device, ops)

    def fusable(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class GemmaMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)) (hidden_activation "gelu_pytorch_tanh"): the fused silu_mul
    of LayerOps is SiLU-only, so it is never asked for."""

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, decode_rows).chunk(2, dim=-1)  # (num_tokens, intermediate) each
        out = self.down_proj(F.gelu(gate, approximate="tanh") * up, decode_rows)
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaDecoderLayer(nn.Module):
    """One Gemma 2 / 3 layer over the paged cache; module names as in the checkpoint."""

    def __init__(
        self,
        config: ModelConfig,
        spec: GemmaSpec,
        layer_idx: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = spec.layer_types[layer_idx]  # picks this layer's RoPE table (GemmaRotary)
        self.input_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.self_attn = Attention(config, dtype, device, ops)
        if config.qk_norm:  # Gemma 3: the per-head norms are (1 + w) norms too
            self.self_attn.q_norm = GemmaRMSNorm(config.head_dim, eps, device, ops)
            self.self_attn.k_norm = GemmaRMSNorm(config.head_dim, eps, device, ops)
        self.self_attn.scale = spec.query_pre_attn_scalar**-0.5
        self.self_attn.sliding_window = spec.sliding_window if self.layer_type == SLIDING else None
        self.self_attn.logit_softcap = spec.attn_logit_softcapping
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, device, ops)
        self.mlp = GemmaMLP(config, dtype, device)  # no fused op applies to a gelu MLP
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, device, ops)

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
        """DecoderLayer's contract: h (num_tokens, hidden) is the residual stream before the previous
        layer's output `residual` is added (None in layer 0; h is updated in place on the native path,
        so it must be a tensor the forward owns). Returns (h, this layer's normalised MLP output).
        cos, sin: this layer's table rows, (num_tokens, 1, head_dim // 2)."""
        h, x = self.input_layernorm.add_and_norm(h, residual)
        attn = self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, layer_idx, meta))
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, attn)
        return h, self.post_feedforward_layernorm(self.mlp(x, meta.num_decode))


class GemmaRotary(nn.Module):
    """The RoPE tables of a Gemma model and which one each layer rotates with.

    Gemma 2: one table (rope_theta, and rope_scaling if any) for every layer. Gemma 3: global layers
    rope_theta with its scaling (linear, factor 8 from 4B up), sliding layers a second, unscaled
    table at rope_local_base_freq. forward() indexes each table once per step; layers of a type get
    the same tensors."""

    def __init__(
        self, config: ModelConfig, spec: GemmaSpec, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        tables = [RotaryEmbedding.from_config(config, dtype, device)]  # global layers: table 0
        if spec.rope_local_base_freq is not None:
            tables.append(
                RotaryEmbedding(
                    config.head_dim, config.max_position_embeddings, spec.rope_local_base_freq, dtype, device
                )
            )
        self.tables = nn.ModuleList(tables)
        local = len(tables) - 1  # sliding layers: the local table, else the shared one
        self.layer_table = [local if t == SLIDING else 0 for t in spec.layer_types]  # layer -> table

    def forward(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """positions (num_tokens,) -> per layer (cos, sin), each (num_tokens, 1, head_dim // 2)."""
        looked_up = [table(positions) for table in self.tables]
        return [looked_up[t] for t in self.layer_table]


def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to the embedding dtype, as transformers multiplies by it (55.5 for
    3072 in bfloat16), as the Python float of that exact value: a tensor times it is computed as
    transformers' tensor times its 0-dim tensor, and a float is safe to build on the meta device."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype))


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (final_logit_softcapping); the logits unchanged when cap is None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class GemmaDecoderModel(nn.Module):
    """The `model.` part of a Gemma checkpoint (embed_tokens, layers, norm) and its forward over the
    paged cache: what DecoderModel + DecoderLM.forward's loop are for Llama. Parameters only, so it
    can be built on "meta" and materialised like DecoderModel; the RoPE tables (GemmaRotary, buffers)
    are the caller's, built on the real device as DecoderLM builds its RotaryEmbedding. Logits are the
    caller's too: soft_cap(hidden @ embed_tokens.weight.T, spec.final_logit_softcapping), tied."""

    def __init__(
        self,
        config: ModelConfig,
        spec: GemmaSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        assert len(spec.layer_types) == config.num_hidden_layers
        self.spec = spec
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, spec, i, dtype, device, ops) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, device, ops)
        self.embed_scale = embed_scale(config.hidden_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids (num_tokens,) int64 and GemmaRotary's per-layer (cos, sin) for their positions ->
        final-normed hidden states (num_tokens, hidden_size)."""
        h = self.embed_tokens(input_ids) * self.embed_scale  # a fresh tensor: the layers may update it
        residual: torch.Tensor | None = None
        for layer_idx, layer in enumerate(self.layers):
            cos, sin = ropes[layer_idx]
            h, residual = layer(h, residual, cos, sin, kv_cache, layer_idx, meta)
        return self.norm.add_and_norm(h, residual)[1]
