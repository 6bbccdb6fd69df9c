"""4-bit test weights: Q4_1-style quantization, and the tiny engine running its projections as int4."""

from __future__ import annotations

import copy
from typing import Any

import torch

from onecall.engine.engine import Engine
from onecall.formats.quants import Int4Groups, Int8Groups, StoredGroups
from onecall.loading.packing import enable_fast_kernels
from tests.helpers.make_models import fast_copy
from tests.helpers.tiny_engine import tiny_engine, tiny_model


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Groups:
    """Asymmetric min/max quantization to 4-bit groups (the Q4_1 recipe), for test weights."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(rows, cols), scale, lo, group_size)


def quantize_int8(w: torch.Tensor, group_size: int = 32) -> Int8Groups:
    """Symmetric absmax quantization to int8 groups (the Q8_0 recipe; group_size 16: Q6_K's grouping)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group_size, group_size)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-8)
    q = (g / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Int8Groups(q.reshape(rows, cols), scale, group_size)


def int4_engine(kernels: str, arch: str = "qwen2", int8_group: int = 0, **config: Any) -> Engine:
    """The tiny engine with its projections rounded to int4 groups (so both paths run the same weights),
    or with int8_group (32: Q8_0-like, 16: Q6_K-like) to int8 groups. qwen2 (the default): q/k/v biases
    go through the quantized path too; qwen3: per-head q/k norms, given weights away from 1 so that a
    path skipping or misapplying them shows."""
    act8 = bool(config.get("int8_activations", False))  # read when packing
    model = fast_copy(tiny_model(arch), act8) if kernels == "fast" else copy.deepcopy(tiny_model(arch))
    c = model.config
    if c.qk_norm:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    splits = {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", q_size),
            ("self_attn.k_proj", kv_size),
            ("self_attn.v_proj", kv_size),
        ],
        "self_attn.o_proj": [("self_attn.o_proj", c.hidden_size)],
        "mlp.gate_up_proj": [("mlp.gate_proj", c.intermediate_size), ("mlp.up_proj", c.intermediate_size)],
        "mlp.down_proj": [("mlp.down_proj", c.hidden_size)],
    }
    int4: dict[str, StoredGroups] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for ours, parts in splits.items():
                owner, attr = ours.split(".")
                lin = getattr(getattr(layer, owner), attr)
                groups = quantize_int8(lin.weight, int8_group) if int8_group else quantize_int4(lin.weight)
                lin.weight.copy_(groups.dequantize())
                start = 0
                for hf_name, size in parts:
                    name = f"model.layers.{i}.{hf_name}.weight"
                    if isinstance(groups, Int8Groups):
                        rows = slice(start, start + size)
                        int4[name] = Int8Groups(groups.q[rows], groups.scale[rows], int8_group)
                    else:
                        int4[name] = groups.select_rows(torch.arange(start, start + size))
                    start += size
    if kernels == "fast":
        assert ("int8" if int8_group else "int4") in enable_fast_kernels(model, int4)
    return tiny_engine(arch=arch, model=model, kernels=kernels, **config)
