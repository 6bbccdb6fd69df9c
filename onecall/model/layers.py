"""Building blocks of the Llama/Qwen decoder: RMSNorm, RoPE, the gated MLP, attention.

Fused projections keep the number of kernel launches (and Python calls) per
layer low, which is what CPU decode pays for besides weight bandwidth:
q/k/v live in one `qkv_proj`, gate/up in one `gate_up_proj`. The loader
(loading/weights.py, load_weights) stacks Hugging Face's separate tensors into them.
Every tensor is (num_tokens, ...): the batch is flat, sequences are told apart
by the AttentionMetadata only.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from onecall.kernels.ops import REFERENCE_OPS, LayerOps, QKNorm
from onecall.model import rope
from onecall.model.attention import paged_attention
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.config import ModelConfig, RopeScaling
from onecall.model.kv_cache import PagedKVCache
from onecall.model.parallel import TensorParallel


class Linear(nn.Linear):
    """nn.Linear without its random initialisation: every weight is loaded from a checkpoint, and
    kaiming_uniform_ costs time even on the meta device (docs/benchmarks.md, "Measurements behind
    the code"). forward takes the step's decode-row count as the fast kernels' FastLinear does, and
    ignores it: one float32 path for every row."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like transformers."""

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.ops = ops  # the model's kernels (kernels/ops.py): add_and_norm as one fused pass

    def fusable(self, dtype: torch.dtype) -> bool:
        """Whether a fused kernel may compute this norm of `dtype` input (LayerOps' RMSNorm rounds as
        forward does; a subclass that rounds otherwise says no)."""
        return True

    def add_and_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm step: h + residual (h may be updated in place by a fused kernel: it must be a
        tensor the forward owns), and its norm. Returns (new h, norm(new h))."""
        if self.fusable(h.dtype):
            y = self.ops.add_rms_norm(h, residual, self.weight, self.eps)
            if y is not None:
                return h, y
        if residual is not None:
            h = h + residual
        return h, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Low precision: normalise in float32, cast back, then scale (transformers' order).
        return F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1, in the non-interleaved (rotate_half) layout.

    Plain or scaled RoPE (model/rope.py: the formulas, and how a partial rotary head is laid out);
    `rotary_dim` < head_dim leaves the last pairs unrotated (cos 1, sin 0)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        # Same float32 arithmetic as transformers' RoPE, then cast to the model dtype.
        inv_freq, attention_factor = rope.inv_freq_and_attention_factor(
            theta, rotary_dim or head_dim, scaling, max_positions
        )
        # (max_positions, head_dim // 2): the two halves of transformers' cat((freqs, freqs)) are equal.
        cos, sin = rope.cos_sin_tables(inv_freq, attention_factor, max_positions, head_dim)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)

    @classmethod
    def from_config(
        cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
    ) -> RotaryEmbedding:
        """The tables of `config`: every position up to max_position_embeddings, its scaling and rotary_dim."""
        return cls(
            config.head_dim, config.max_position_embeddings, config.rope_theta, dtype, device,
            scaling=config.rope_scaling, rotary_dim=config.rotary_dim,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (num_tokens,) -> cos, sin each (num_tokens, 1, head_dim // 2), broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (num_tokens, heads, head_dim) by position: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * i, bias=False, dtype=dtype, device=device)  # rows: [gate; up]
        self.down_proj = Linear(i, h, bias=False, dtype=dtype, device=device)
        self.ops = ops  # the model's kernels: silu(gate) * up in one pass
        self.tp: TensorParallel | None = None  # tensor parallel: down_proj's partial sums all-reduced

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """x (num_tokens, hidden); `decode_rows`: the step's AttentionMetadata.num_decode, for the
        projections."""
        y = self.gate_up_proj(x, decode_rows)
        act = self.ops.silu_mul(y)
        if act is None:
            gate, up = y.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act, decode_rows)
        return out if self.tp is None else self.tp.all_reduce(out)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache; optional q/k/v bias (qwen2) and q/k norm (qwen3)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: LayerOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # rows: [q (num_heads * head_dim); k (num_kv_heads * head_dim); v (num_kv_heads * head_dim)]
        self.qkv_proj = Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias, dtype=dtype, device=device
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype, device=device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
        # Per-layer departures from plain causal attention (model/attention.py: paged_attention).
        self.sliding_window: int | None = config.sliding_window
        self.logit_softcap: float | None = None
        self.ops = ops  # the model's kernels: q/k norms, RoPE and the K/V cache write in one pass
        self.tp: TensorParallel | None = None  # tensor parallel: o_proj's partial sums all-reduced

    def fused_qk_norm(self, dtype: torch.dtype) -> tuple[bool, QKNorm | None]:
        """Whether a fused RoPE pass may run for `dtype` activations, and the (q weight, k weight, eps)
        of its q/k norms (None without them); not where a norm rounds otherwise (RMSNorm.fusable)."""
        if self.q_norm is None or self.k_norm is None:
            return True, None
        assert self.q_norm.eps == self.k_norm.eps
        ok = self.q_norm.fusable(dtype) and self.k_norm.fusable(dtype)
        return ok, (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv_flat = self.qkv_proj(x, meta.num_decode)  # (num_tokens, (heads + 2 * kv_heads) * head_dim)
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
        out = self.o_proj(o.reshape(n, self.num_heads * self.head_dim), meta.num_decode)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _options(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window, "logit_softcap": self.logit_softcap}

    def qkv_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The torch path's q, k, v for (num_tokens, hidden) x: the fused projection, Qwen3's per-head
        q/k norms, RoPE on q and k. (num_tokens, heads, head_dim) each; also what the attention
        probe (model/attention_probe.py) attends with."""
        return self._rotated_heads(self.qkv_proj(x), cos, sin)

    def _rotated_heads(
        self, qkv_flat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = qkv_flat.shape[0]
        # (num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        qkv = qkv_flat.view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k rotated in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class ModelPart(Protocol):
    """What a family's own forward loop (model/gemma4.py, model/deepseek.py) reads of the `model.` part:
    a DecoderModel built with that family's layers."""

    @property
    def embed_tokens(self) -> nn.Module: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...
