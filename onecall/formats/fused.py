"""Fused checkpoint projections split into the parts our model loads (Phi-3's qkv_proj, gate_up_proj),
and the rows of a stored (quantized) weight picked out with them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping

import torch

from onecall.errors import UnsupportedModelError
from onecall.formats.quants import StoredGroups
from onecall.model.config import ModelConfig


def split_fused_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    stored_weights: MutableMapping[str, StoredGroups] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint that stores fused projections (Phi-3: `self_attn.qkv_proj` rows [q; k; v],
    `mlp.gate_up_proj` rows [gate; up], as ours) yields each part under its separate Hugging Face name
    (row views, no copy); every other tensor passes through. Sizes from `config` (the full model's:
    tensor parallel shards after this). A fused tensor's stored groups (a quantized Phi-3 GGUF's
    attn_qkv / ffn_up) are split the same way, each part's rows stored under its name before it is
    yielded, so the fast kernels find them as they find separately stored parts."""
    c = config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    sizes = {
        "self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        "mlp.gate_up_proj": (("mlp.gate_proj", inter), ("mlp.up_proj", inter)),
    }
    for name, tensor in weights:
        fused = next((f for f in sizes if f".{f}." in name), None)
        if fused is None:
            yield name, tensor
            continue
        total = sum(rows for _, rows in sizes[fused])
        if tensor.shape[0] != total:
            raise UnsupportedModelError(
                f"tensor {name!r} has {tensor.shape[0]} rows, expected {total} ({' + '.join(p for p, _ in sizes[fused])})"
            )
        groups = stored_weights.get(name) if stored_weights is not None else None
        start = 0
        for part, rows in sizes[fused]:
            part_name = name.replace(fused, part)
            if groups is not None and stored_weights is not None:
                stored_weights[part_name] = stored_rows(groups, torch.arange(start, start + rows))
            yield part_name, tensor[start : start + rows]
            start += rows


def stored_rows(groups: StoredGroups, index: torch.Tensor) -> StoredGroups:
    """The given rows of a stored weight (groups run along a row, so rows split and permute freely)."""
    return groups.select_rows(index)
