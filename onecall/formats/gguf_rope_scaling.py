"""A GGUF's RoPE scaling, read back into the rope_scaling dict of the config.json it was converted
from (formats/gguf_layout.py's gguf_config_dict puts it there; model_config_from_hf checks it).

llama.cpp's converter writes a RoPE scaling two ways: as `{arch}.rope.scaling.*` metadata keys
(linear, yarn), or as small float tensors beside the weights (Llama 3.1+'s rope_freqs, Phi-3's
rope_factors_long/short), which the weight iterator skips (gguf_layout.SKIPPED_TENSORS) and this
module reads instead: the only part of reading a GGUF's layout that touches tensor data. A key or
type llama.cpp would run differently from the HF config we derive is refused by name, never ignored.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onecall.errors import UnsupportedModelError
from onecall.formats.ggml_types import GGMLType, GGUFView, checked_value, ggml_type_name
from onecall.formats.quants import SUPPORTED_QUANT_TYPES, dequantize

# {arch}.rope.scaling.* keys that only llama.cpp's own yarn variants set, with the value at which they
# change nothing: any other value is refused rather than ignored.
_NEUTRAL_YARN_KEYS = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}
# what the rope.scaling.* keys read here hold (checked_value refuses anything else by name)
_SCALING_KINDS = {"type": "string", "factor": "number", "original_context_length": "count",
                  "yarn_beta_fast": "number", "yarn_beta_slow": "number", "finetuned": "flag",
                  **dict.fromkeys(_NEUTRAL_YARN_KEYS, "number")}  # fmt: skip


def rope_scaling_dict(gguf: GGUFView, arch: str) -> dict[str, Any] | None:
    """The RoPE scaling the converter wrote -> an HF-style rope_scaling dict (ModelConfig checks it).

    | GGUF                                                | rope_scaling                                  |
    |-----------------------------------------------------|-----------------------------------------------|
    | rope.scaling.type linear, .factor (or scale_linear) | linear, factor                                |
    | rope.scaling.type yarn, .factor,                    | yarn, factor, original_max_position_embeddings|
    |   .original_context_length, .yarn_beta_fast/_slow   |   beta_fast, beta_slow                        |
    | tensor rope_freqs.weight (Llama 3.1+: no keys)      | llama3, freq_factors (inv_freq divisors)      |
    | phi3: tensors rope_factors_long/short,              | longrope, long/short_factor, original_...,    |
    |   .original_context_length, .attn_factor           |   attention_factor (if not the derived one)   |
    | deepseek2: yarn plus .yarn_log_multiplier (required)| yarn, mscale = mscale_all_dim = it / 0.1       |
    Anything else (unknown keys or types) is refused by name.
    """
    meta = gguf.metadata
    prefix = f"{arch}.rope.scaling."
    scaling = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    for name in scaling.keys() & _SCALING_KINDS.keys():
        checked_value(meta, prefix + name, None, _SCALING_KINDS[name])
    if arch == "phi3":
        return _phi3_longrope(gguf, scaling)
    rope_type = scaling.pop("type", None)
    scaling.pop("finetuned", None)  # informational only
    # deepseek2: 0.1 * mscale_all_dim (DeepseekV2Model's; llama.cpp divides the 0.1 back out)
    log_mul = scaling.pop("yarn_log_multiplier", None) if arch == "deepseek2" else None
    for name, neutral in _NEUTRAL_YARN_KEYS.items():
        if name in scaling and scaling.pop(name) != neutral:
            raise UnsupportedModelError(
                f"GGUF key {prefix}{name} (llama.cpp's yarn variant) is not supported"
            )
    factor = scaling.pop("factor", None)
    original = scaling.pop("original_context_length", None)
    rope: dict[str, Any] | None = None
    if rope_type == "linear":
        rope = {"rope_type": "linear", "factor": factor}
    elif rope_type == "yarn":
        rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if theirs in scaling:
                rope[ours] = scaling.pop(theirs)
        if arch == "deepseek2":
            rope |= _deepseek2_mscale(log_mul, prefix)
    elif rope_type not in (None, "none"):
        raise UnsupportedModelError(
            f"GGUF {prefix}type {rope_type!r} is not supported (only linear and yarn)"
        )
    if scaling:
        raise UnsupportedModelError(
            f"GGUF keys {', '.join(prefix + k for k in sorted(scaling))} are not supported"
        )
    linear = checked_value(meta, f"{arch}.rope.scale_linear", None, "number")
    if rope is None and linear not in (None, 1.0):
        rope = {"rope_type": "linear", "factor": linear}
    freqs = _float_tensor(gguf, "rope_freqs.weight")
    if freqs is not None:
        if rope is not None:
            raise UnsupportedModelError(
                f"{gguf.path.name} has both rope_freqs.weight and {rope['rope_type']} RoPE scaling"
            )
        rope = {"rope_type": "llama3", "freq_factors": freqs}
    return {k: v for k, v in rope.items() if v is not None} if rope is not None else None


def _deepseek2_mscale(log_mul: Any, prefix: str) -> dict[str, float]:
    """deepseek2's yarn as llama.cpp runs it: the softmax scaled by mscale(factor, log_mul / 0.1)^2 and the
    cos/sin by 1 (its ratio mscale / mscale_all_dim is 1 for this arch): transformers' DeepseekV3 with
    mscale = mscale_all_dim = log_mul / 0.1. Without the key llama.cpp would scale cos/sin instead, which
    no DeepSeek-V3 conversion writes: refused."""
    if log_mul is None or isinstance(log_mul, bool) or not isinstance(log_mul, (int, float)) or log_mul <= 0:
        raise UnsupportedModelError(
            f"deepseek2 yarn RoPE needs {prefix}yarn_log_multiplier (0.1 * mscale_all_dim, as llama.cpp's "
            f"converter writes it) to be positive, got {log_mul!r}"
        )
    mscale = float(log_mul) / 0.1
    return {"mscale": mscale, "mscale_all_dim": mscale}


def _phi3_longrope(gguf: GGUFView, scaling: dict[str, Any]) -> dict[str, Any] | None:
    """Phi-3's longrope as Phi3MiniModel writes it: the two factor sets as tensors, the original context
    as rope.scaling.original_context_length, and the cos/sin multiplier it derived, as attn_factor
    (sqrt(1 + ln(factor) / ln(original)), factor = context_length / original: transformers' default,
    which is kept implicit unless the file says otherwise). Without factor tensors: plain RoPE."""
    original = scaling.pop("original_context_length", None)
    attn_factor = scaling.pop("attn_factor", None)
    if scaling:
        raise UnsupportedModelError(f"GGUF keys {', '.join('phi3.rope.scaling.' + k for k in sorted(scaling))} "
                                    "are not supported")  # fmt: skip
    long, short = (
        _float_tensor(gguf, "rope_factors_long.weight"),
        _float_tensor(gguf, "rope_factors_short.weight"),
    )
    if long is None and short is None:
        return None
    if long is None or short is None or original is None:
        raise UnsupportedModelError(
            f"{gguf.path.name}: phi3 longrope needs rope_factors_long, rope_factors_short and "
            "phi3.rope.scaling.original_context_length"
        )
    rope: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                            "original_max_position_embeddings": original}  # fmt: skip
    factor = checked_value(gguf.metadata, "phi3.context_length", original, "count") / original
    derived = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 and original > 1 else 1.0
    if attn_factor is not None and abs(attn_factor - derived) > 1e-6 * derived:  # float32-stored
        rope["attention_factor"] = attn_factor
    return rope


def _float_tensor(gguf: GGUFView, name: str) -> list[float] | None:
    """A small 1-D tensor of the file (RoPE factors) as Python floats, or None if absent."""
    info = next((t for t in gguf.tensors if t.name == name), None)
    if info is None:
        return None
    if info.ggml_type not in SUPPORTED_QUANT_TYPES or len(info.shape) != 1:
        raise UnsupportedModelError(
            f"GGUF tensor {name!r} must be 1-D, in a type onecall reads: it has shape {info.shape}, "
            f"type {ggml_type_name(info.ggml_type)}"
        )
    values = dequantize(gguf.raw_data(info), GGMLType(info.ggml_type), info.shape, torch.float32)
    return [float(v) for v in values.flatten().tolist()]
