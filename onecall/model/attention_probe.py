"""Attention probabilities of the last position, per layer: a separate path the fast path never pays for.

The engine's forward (DecoderLM.forward over the paged cache) never materialises attention
probabilities: SDPA fuses the softmax away. This module runs the same model a second way, for
inspection only (the lab's "template" experiment):

    ids (seq_len,) -> embed -> for each layer:
        x = input_layernorm(h)
        q, k, v = self_attn.qkv_heads(x)                     (projection, q/k norm, RoPE: the layer's own)
        scores = q k^T * scale + causal mask                 (plain matmuls, float32 softmax, like
        p = softmax(scores); o = p v; h += o_proj(o)          transformers' eager attention)
        h += mlp(post_attention_layernorm(h))
    -> p[:, :, -1, :] averaged over heads, per layer: (num_layers, seq_len)

Everything except the attention core calls the model's own modules (a projection swapped for a
FastLinear by the fast kernels is still a callable module), so the arithmetic is the model's; no KV
cache, no paging, one sequence. GQA: query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch

from onecall.errors import UnsupportedModelError
from onecall.model.decoder import DecoderLayer, DecoderLM
from onecall.model.layers import Attention


@torch.inference_mode()
def last_position_attention(model: DecoderLM, input_ids: torch.Tensor) -> torch.Tensor:
    """(seq_len,) int64 prompt ids -> (num_layers, seq_len) float32: for each layer, the softmax
    attention of the last position over every position, averaged over heads. Each row sums to 1."""
    assert input_ids.dim() == 1 and input_ids.numel() > 0, "one non-empty sequence of ids"
    device = model.model.norm.weight.device
    ids = input_ids.to(device=device, dtype=torch.int64)
    positions = torch.arange(ids.numel(), device=device)
    others = {type(layer).__name__ for layer in model.model.layers if not isinstance(layer, DecoderLayer)}
    if others:  # Gemma's four norms, a hybrid's linear layers, gpt-oss's sinks: not probed here yet
        raise UnsupportedModelError(
            f"attention probabilities are computed for Llama-shaped layers; {model.config.architecture}'s "
            f"{', '.join(sorted(others))} are not"
        )
    h = model.model.embed_tokens(ids)  # (seq_len, hidden_size)
    cos, sin = model.rotary(positions)  # (seq_len, 1, head_dim // 2) each
    rows = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        out, probs = _attention_with_probs(layer.self_attn, layer.input_layernorm(h), cos, sin)
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        rows.append(probs[:, -1, :].mean(dim=0))  # last query, averaged over heads: (seq_len,)
    return torch.stack(rows).float().cpu()


def _attention_with_probs(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention.forward's math without the cache: (seq_len, hidden) -> output (seq_len, hidden) and
    probabilities (num_heads, seq_len, seq_len) float32."""
    n, num_heads, num_kv_heads, head_dim = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    # 1. projections, q/k norm and RoPE: the torch path's own (Attention.qkv_heads)
    q, k, v = attn.qkv_heads(x, cos, sin)

    # 2. GQA: repeat each KV head for its group of query heads -> (num_heads, seq_len, head_dim)
    group = num_heads // num_kv_heads
    q = q.transpose(0, 1)
    k = k.transpose(0, 1).repeat_interleave(group, dim=0)
    v = v.transpose(0, 1).repeat_interleave(group, dim=0)

    # 3. causal scores, softmax in float32 (transformers' eager), then back to the model dtype
    scores = torch.matmul(q, k.transpose(1, 2)).float() * attn.scale  # (num_heads, seq_len, seq_len)
    future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    o = torch.matmul(probs.to(v.dtype), v)  # (num_heads, seq_len, head_dim)
    return attn.o_proj(o.transpose(0, 1).reshape(n, num_heads * head_dim)), probs
