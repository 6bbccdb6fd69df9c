"""The native C kernels behind kernels/ops.py's interface (float32 CPU).

NativeLayerOps: the fused small ops of a layer (csrc/decode_step.c holds them, called through
native.py) and a Gated DeltaNet layer's decode rows (csrc/delta_rule.c); NativeAttention: paged
decode rows and prefill chunks read in place through the block tables (csrc/decode_attention.c,
csrc/prefill_attention.c). Each declines (None / False) what its kernel does
not take, and the caller's torch code runs instead: a non-float32 tensor, a cache dtype outside
native.KV_DTYPES, head shapes the attention kernels were not built for. Both attention kernels take
attention sinks (gpt-oss: kernels/ops.py), folded into each row's softmax in C.
"""

from __future__ import annotations

import ctypes

import torch

from onecall.kernels.cpu import native
from onecall.kernels.ops import AttentionKernels, DeltaNetWeights, LayerOps, QKNorm


class NativeLayerOps(LayerOps):
    """A float32 CPU model's fused ops (select.layer_ops picks it where the kernels are built)."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def add_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        if h.dtype != torch.float32 or weight.dtype != torch.float32:
            return None
        return native.add_rms_norm(self.lib, h, residual, weight, eps)

    def silu_mul(self, y: torch.Tensor) -> torch.Tensor | None:
        if y.dtype != torch.float32 or not y.is_contiguous():
            return None
        return native.silu_mul(self.lib, y)

    def rope_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qk_norm: QKNorm | None,
    ) -> bool:
        head_dim = k_cache.shape[-1]
        if (
            qkv.dtype != torch.float32
            or k_cache.dtype not in native.KV_DTYPES
            or (k_cache.dtype != torch.float32 and num_kv_heads * head_dim % 8)
            or 2 * cos.shape[-1] != head_dim
        ):
            return False
        native.rope_store(
            self.lib, qkv, num_heads, num_kv_heads, cos, sin, slot_mapping, k_cache, v_cache, qk_norm
        )
        return True

    def delta_decode_rows(
        self,
        proj: torch.Tensor,
        weights: DeltaNetWeights,
        slots: torch.Tensor,
        fresh: torch.Tensor | None,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor | None:
        w = weights
        tensors = (proj, conv_state, recurrent_state, w.conv_weight, w.A_log, w.dt_bias, w.norm_weight)
        if (
            any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
            or slots.dtype != torch.int64
            or slots.device.type != "cpu"
            or proj.stride(1) != 1
            or not (conv_state.is_contiguous() and recurrent_state.is_contiguous())
            or recurrent_state.shape[2] != w.k_head_dim
            or max(w.k_head_dim, recurrent_state.shape[3]) > native.DELTA_MAX_DIM
            or recurrent_state.shape[1] % w.num_k_heads
            or w.conv_weight.shape[-1] < 2
        ):
            return None
        return native.delta_decode_rows(
            self.lib, proj, slots.contiguous(), fresh, conv_state, recurrent_state, w.conv_weight, w.A_log,
            w.dt_bias, w.norm_weight, w.num_k_heads, w.l2_eps, w.norm_eps, torch.get_num_threads(),
        )  # fmt: skip


class NativeAttention(AttentionKernels):
    """The "paged" backend's kernels on CPU (select.attention_kernels picks them where they are built)."""

    name = "native"
    reads_decode_rows = True
    reads_prefill_chunks = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        if not native.decode_attention_fits(q, k_cache):
            return None
        return native.paged_decode_attention(
            self.lib, q, k_cache, v_cache, block_tables, seq_lens, block_size, scale,
            torch.get_num_threads(), sliding_window, logit_softcap, sinks,
        )  # fmt: skip

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq_len: int,
        kv_start: int,
        blocks: torch.Tensor | None,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        if q.shape[0] < 2 or not native.prefill_attention_fits(q, k_cache):
            return None
        return native.prefill_attention(
            self.lib, q, k_cache, v_cache, seq_len, kv_start, blocks, block_size, scale,
            torch.get_num_threads(), sliding_window, logit_softcap, sinks,
        )  # fmt: skip
