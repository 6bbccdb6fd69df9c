"""NativeDecodeStep: a decode step's whole forward, every layer, in one call into the native kernels.

The per-op fast path (model/layers.py with FastLinear) makes about twenty Python-level calls a layer:
module dispatch, a ctypes call per kernel, a tensor per intermediate. At batch 1 on a 135M model
that is a third of a decode step. When every row of a step is a decode row and every projection
runs a native kernel (4-bit, or int8 groups), `csrc/decode_step.c: onecall_decode_layers` runs the same kernels in
the same order over the same values from C, so:

- a decode row's bits do not depend on which path ran it (a mixed step takes the per-op path, a
  pure decode step this one): batch invariance holds across both, and tests/kernels/test_native_step.py
  checks the two paths bitwise;
- the step's Python cost is one ctypes call: the embedding rows and the RoPE tables' rows are
  gathered in C (token ids and positions are checked against the tables' sizes there first).

`NativeDecodeStep.build(model)` returns None (and the per-op path stays the only one) for a model it
cannot run: a projection whose rows do not all run on native GEMMs (a part not stored in a form one
runs, quants.py's table; parts in several forms are fine: a Q4_K_M file's q/k beside its v run as a
chain of parts, kernels.h's Q4Weight), norms with different eps, or the native kernels unavailable. Qwen3's per-head q/k norms run inside the RoPE pass on both paths.
A token embedding kept as 5-bit groups, K-quant codes or 16-bit floats (which onecall_decode_layers does not gather)
is looked up first, as the per-op path looks it up, and handed over as a float32 table of those rows.
"""

from __future__ import annotations

import ctypes
from ctypes import Array
from typing import cast

import torch
from torch import nn

from onecall.kernels.cpu import native
from onecall.kernels.cpu.fast_embedding import StoredEmbedding
from onecall.kernels.cpu.fast_linear import FastLinear, num_decode_rows
from onecall.kernels.cpu.ops import NativeLayerOps
from onecall.model.attention_metadata import AttentionMetadata
from onecall.model.decoder import DecoderLayer, DecoderModel
from onecall.model.gemma import GemmaDecoderModel
from onecall.model.kv_cache import PagedKVCache
from onecall.model.layers import MLP


def _part(w: native.Packed, bias: int, n: int, k: int) -> native.Q4Weight:
    """kernels.h's Q4Weight for one part of a projection, n rows, in the layout its kernel reads."""
    if isinstance(w, (native.Q4Packed, native.Q5Packed)):
        f16 = int(w.scale.dtype == torch.float16)
        if isinstance(w, native.Q4Packed):
            f16 = native.q4_scales_mode(w)  # 2: super-block factors (native.pack_q4_super)
        act8 = int(isinstance(w, native.Q4Packed) and w.act8)
        q5 = int(isinstance(w, native.Q5Packed))
        return native.Q4Weight(
            w.qs.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), bias, n, k, f16, 0, act8, q5, 0, 0, None
        )
    if isinstance(w, native.Q8Blocked):
        return native.Q4Weight(w.qs.data_ptr(), w.scale.data_ptr(), 0, bias, n, k, 0, w.group_size, 0, 0, 0, 0, None)
    if isinstance(w, native.KQPacked):  # kbits (after next): the sub-scales in scale, supers in offset
        part = native.Q4Weight(
            w.qs.data_ptr(), w.scales.data_ptr(), w.supers.data_ptr(), bias, n, k, 0, 0, 0, 0, 0, 0
        )
        part.kbits = w.bits
        return part
    if isinstance(w, native.IQ4Packed):
        f16 = int(w.scale.dtype == torch.float16)
        iq4 = 1 + w.codebook_id  # kernels.h: 1 + the codebook's number
        return native.Q4Weight(w.qs.data_ptr(), w.scale.data_ptr(), 0, bias, n, k, f16, 0, 0, 0, 0, iq4, None)
    half = 2 if w.values.dtype == torch.bfloat16 else 1
    return native.Q4Weight(w.values.data_ptr(), 0, 0, bias, n, k, 0, 0, 0, 0, half, 0, None)


def _q4_weight(linear: nn.Module, keep: list[native.Q4Weight]) -> native.Q4Weight | None:
    """The projection's native decode weight (kernels.h's Q4Weight, mirrored in native_abi.py and
    checked against the header at load): its q4 copy, or its parts (5-bit or int8 groups, IQ4 codes, 16-bit floats,
    4-bit ones beside them) as a chain, the first holding the whole projection's bias. The chain's later
    links are appended to `keep`, which must outlive the step (the first is copied into its layer)."""
    if not isinstance(linear, FastLinear):
        return None
    bias = 0 if linear.bias is None else linear.bias.data_ptr()
    k = linear.in_features
    parts = [(0, linear.out_features, linear.q4)] if linear.q4 is not None else linear.parts
    if not parts:
        return None
    chain = [_part(w, bias if i == 0 else 0, end - start, k) for i, (start, end, w) in enumerate(parts)]
    for this, following in zip(chain, chain[1:]):
        this.next = ctypes.addressof(following)
    keep.extend(chain[1:])
    return chain[0]


class NativeDecodeStep:
    """Runs DecoderModel's layers and final norm for an all-decode step in one native call."""

    def __init__(
        self, lib: ctypes.CDLL, layers: Array[native.DecodeLayer], model: DecoderModel, links: list[native.Q4Weight]
    ) -> None:
        first = cast(DecoderLayer, model.layers[0])
        attn = first.self_attn
        self._lib = lib
        self._layers = layers  # the tensors these structs point at are the model's own
        self._links = links  # the parts after the first of projections stored in parts: the layers point here
        self._final_norm = model.norm
        embed = model.embed_tokens  # build() checked it: float32 rows, or a StoredEmbedding
        self._embed_f32 = embed.weight if isinstance(embed, nn.Embedding) else None
        table = embed.table if isinstance(embed, StoredEmbedding) else None
        # int8 / 4-bit groups the C step gathers itself; other tables are looked up here first
        self._embed_groups = table if isinstance(table, (native.Q8Blocked, native.Q4Packed)) else None
        self._embed_first = embed if table is not None and self._embed_groups is None else None
        self._vocab = int(cast(int, embed.num_embeddings))
        self._scale = attn.scale
        self._num_heads, self._num_kv_heads, self._head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self._hidden = first.input_layernorm.weight.shape[0]
        self._intermediate = cast(MLP, first.mlp).down_proj.in_features

    @classmethod
    def build(cls, model: DecoderModel | GemmaDecoderModel) -> NativeDecodeStep | None:
        """The step for a DecoderModel whose fast kernels are installed, or None where it cannot run
        its layers exactly as the per-op path does (see the module docstring)."""
        lib = native.load()
        if not isinstance(model, DecoderModel) or any(
            type(layer) is not DecoderLayer or type(layer.mlp) is not MLP for layer in model.layers
        ):
            return None  # another layer's structure (Gemma's four norms, gelu, per-layer RoPE; MoE MLPs)
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        if lib is None or not layers:
            return None
        embed = model.embed_tokens
        if not isinstance(embed, StoredEmbedding) and (
            not isinstance(embed, nn.Embedding)
            or embed.weight.dtype != torch.float32
            or not embed.weight.is_contiguous()
            or embed.weight.device.type != "cpu"
        ):
            return None  # the step gathers its rows in C: from a float32 table or int8 / 4-bit groups
        structs = []
        links: list[native.Q4Weight] = []  # the later parts of projections stored in parts
        for layer in layers:
            attn, mlp = layer.self_attn, cast(MLP, layer.mlp)  # checked above: every MLP is dense
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(isinstance(m.ops, NativeLayerOps) for m in (attn, mlp, *norms)):
                return None  # the layers were built on other ops: the step would not match them
            fusable, qk_norm = attn.fused_qk_norm(torch.float32)
            if not fusable:
                return None
            if any(n.eps != model.norm.eps for n in norms) or qk_norm and qk_norm[2] != model.norm.eps:
                return None  # the step takes one eps
            weights = [_q4_weight(p, links) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(w is None for w in weights):
                return None
            q_norm, k_norm = (qk_norm[0].data_ptr(), qk_norm[1].data_ptr()) if qk_norm else (None, None)
            window, softcap = attn.sliding_window or 0, attn.logit_softcap or 0.0
            norm_ptrs = (norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), q_norm, k_norm)
            structs.append(native.DecodeLayer(*norm_ptrs, window, softcap, *weights))
        return cls(lib, (native.DecodeLayer * len(structs))(*structs), model, links)

    def accepts(self, meta: AttentionMetadata, kv_cache: PagedKVCache, num_rows: int) -> bool:
        """Whether this step is one it runs exactly like the per-op path: every row a one-query sequence
        in row order, every projection call on its native decode kernel, a cache the native attention reads."""
        d = meta.decode
        return (
            d is not None
            and d.rows_are_prefix
            and len(d.seq_index) == num_rows == len(meta.seqs)
            and num_decode_rows(num_rows, meta.num_decode) == num_rows
            and kv_cache.k.dtype in native.KV_DTYPES
            and kv_cache.k.is_contiguous()
            and kv_cache.v.is_contiguous()
            and self._num_heads <= native.ATTENTION_MAX_HEADS
            and self._head_dim % 8 == 0
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions (M,) int64; cos_table, sin_table (max_positions, head_dim / 2) float32, the
        RoPE tables. Returns the final norm's output (M, hidden)."""
        d = meta.decode
        assert d is not None and input_ids.dtype == positions.dtype == torch.int64
        assert input_ids.is_contiguous() and positions.is_contiguous()
        assert cos_table.is_contiguous() and sin_table.is_contiguous()
        assert cos_table.dtype == sin_table.dtype == torch.float32 and cos_table.shape == sin_table.shape
        assert cos_table.shape[1] == self._head_dim // 2, "RoPE tables hold head_dim / 2 columns"
        m = input_ids.shape[0]
        out = torch.empty(m, self._hidden)
        k, v = kv_cache.k, kv_cache.v
        f32, g, vocab = self._embed_f32, self._embed_groups, self._vocab
        if self._embed_first is not None:  # the rows the per-op path looks up, as a table of M rows
            f32, vocab = self._embed_first(input_ids).contiguous(), m
            input_ids = torch.arange(m)
        rc = self._lib.onecall_decode_layers(
            self._layers, len(self._layers), input_ids.data_ptr(), None if f32 is None else f32.data_ptr(),
            None if g is None else g.qs.data_ptr(), None if g is None else g.scale.data_ptr(),
            g.offset.data_ptr() if isinstance(g, native.Q4Packed) else None,
            int(g.scale.dtype == torch.float16) if isinstance(g, native.Q4Packed) else g.group_size if g else 0,
            vocab, m, self._hidden, self._num_heads, self._num_kv_heads, self._head_dim, self._intermediate,
            self._final_norm.eps, self._scale, positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
            cos_table.shape[0], meta.slot_mapping.data_ptr(), k.data_ptr(), v.data_ptr(),
            k[0].numel(), int(k.dtype == torch.float16), d.block_tables.data_ptr(), d.block_tables.shape[1],
            d.seq_lens.data_ptr(), meta.block_size, self._final_norm.weight.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("onecall_decode_layers: out of memory for its activation buffers")
        if rc == -3:
            raise IndexError(f"onecall_decode_layers: a token id outside the vocabulary ({self._vocab})")
        if rc == -4:
            raise IndexError(
                f"onecall_decode_layers: a position outside the RoPE tables ({cos_table.shape[0]})"
            )
        assert rc == 0, f"onecall_decode_layers refused the shapes (rc {rc})"
        return out
