"""The RoPE part of a Hugging Face config.json -> RopeScaling and the partial rotary factor, for
formats/hf_config.py (which reads rope_theta itself, with the other scalars).

Where a file keeps its RoPE parameters, and which wins (transformers' convert_rope_params_to_dict):

    rope_scaling        older files: {"rope_type" (or "type"): ..., "factor": ..., ...}; wins
    rope_parameters     transformers 5: the same dict (with rope_theta in it), or one dict per layer
                        type, which only Gemma 3 has (gemma3_rope_as_one folds it into the one-dict
                        form before anything else reads it; any other family's is refused by name)
    top level           original_max_position_embeddings (Phi-3) wins over the dict's;
                        partial_rotary_factor when the dict has none

Each rope type's numbers are checked and named in the UnsupportedModelError (`{key} {name} must
be ...`, key being the dict the file used), so a file our RoPE tables (model/rope.py) would compute
wrong is refused before any weight loads.
"""

from __future__ import annotations

from typing import Any

from onecall.errors import UnsupportedModelError
from onecall.model.config import GLOBAL, HYBRID, ROPE_TYPES, SLIDING, RopeScaling


def gemma3_rope_as_one(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's two RoPEs as the rest of the parsing reads one: transformers 5 writes
    rope_parameters per layer type ({full_attention: ..., sliding_attention: ...}); the global layers'
    dict becomes rope_parameters (theta and scaling) and the sliding layers' theta rope_local_base_freq,
    which is where older config.json files keep it (with rope_theta / rope_scaling at the top)."""
    params = d.get("rope_parameters")
    if not isinstance(params, dict) or not any(isinstance(v, dict) for v in params.values()):
        return d
    extra = sorted(set(params) - {SLIDING, GLOBAL})
    if extra:
        raise UnsupportedModelError(f"rope_parameters for layer types {extra!r} are not supported")
    local = params.get(SLIDING) or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(
            f"rope_parameters.{SLIDING} rope_type {local.get('rope_type')!r} is not supported; "
            "Gemma 3's sliding layers use plain RoPE"
        )
    d = {**d, "rope_parameters": params.get(GLOBAL) or {}}
    if local.get("rope_theta") is not None:
        d["rope_local_base_freq"] = local["rope_theta"]
    return d


def _rope_dict(d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(key, dict) of the RoPE parameters: `rope_scaling` (older files) wins over `rope_parameters`
    (transformers 5), as transformers' convert_rope_params_to_dict reads them; ("", {}) if neither."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None or rope == {}:
            continue
        if not isinstance(rope, dict):
            raise UnsupportedModelError(f"{key} must be a dict or null, got {rope!r}")
        if any(isinstance(v, dict) for v in rope.values()):
            raise UnsupportedModelError(
                f"{key} per layer type ({', '.join(k for k, v in rope.items() if isinstance(v, dict))}) "
                "is not supported; only one RoPE for every layer is"
            )
        return key, rope
    return "", {}


def partial_rotary_from_hf(d: dict[str, Any], arch: str) -> float:
    """The fraction of each head RoPE rotates: Phi-3's per config, the Qwen3.5 / Qwen3-Next hybrids'
    0.25 unless the config says otherwise (transformers' default for them); 1 for every other family."""
    _, rope = _rope_dict(d)
    value = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if value is None:
        value = 0.25 if arch in HYBRID else 1.0
    if value == 1.0:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor must be a number in (0, 1], got {value!r}")
    if arch != "phi3" and arch not in HYBRID:
        raise UnsupportedModelError(
            f"partial_rotary_factor {value!r} is not supported for {arch}; only phi3 and "
            f"{', '.join(HYBRID)} rotate part of a head"
        )
    return float(value)


def rope_scaling_from_hf(
    d: dict[str, Any], arch: str, max_positions: int, rotary_dim: int
) -> RopeScaling | None:
    """Phases: 1. the type (phi3's old names), 2. the numbers each type needs, checked and named."""
    key, rope = _rope_dict(d)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if arch == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi3Config reads both old names as longrope
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{key} rope_type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_TYPES)}"
        )
    if arch == "phi3" and rope_type != "longrope":
        raise UnsupportedModelError(
            f"{key} rope_type {rope_type!r} is not supported for phi3; only longrope is"
        )

    def number(name: str, default: float | None = None, minimum: float = 0.0) -> float | None:
        value = rope.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > minimum:
            raise UnsupportedModelError(f"{key} {name} must be a number > {minimum:g}, got {value!r}")
        return float(value)

    def required(name: str) -> float:
        value = number(name)
        if value is None:
            raise UnsupportedModelError(f"{key} with rope_type {rope_type!r} needs {name}")
        return value

    def factors(name: str) -> tuple[float, ...]:
        value = rope.get(name)
        if (
            not isinstance(value, list)
            or len(value) != rotary_dim // 2
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value)
        ):
            raise UnsupportedModelError(
                f"{key} {name} must be a list of {rotary_dim // 2} positive numbers, got {value!r}"
            )
        return tuple(float(x) for x in value)

    # transformers: a top-level original_max_position_embeddings (Phi-3) wins over the dict's,
    # and the dict's defaults to max_position_embeddings.
    original = d.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
    if original is None:
        original = max_positions
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise UnsupportedModelError(
            f"original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    if rope_type in ("linear", "dynamic"):
        return RopeScaling(rope_type, factor=required("factor"))
    if rope_type == "llama3":
        if "freq_factors" in rope:  # a GGUF's rope_freqs tensor (formats/checkpoint.py)
            return RopeScaling(rope_type, freq_factors=factors("freq_factors"))
        low, high = required("low_freq_factor"), required("high_freq_factor")
        if high <= low:
            raise UnsupportedModelError(
                f"{key} high_freq_factor ({high}) must exceed low_freq_factor ({low})"
            )
        return RopeScaling(
            rope_type, factor=required("factor"), original_max_position_embeddings=original,
            low_freq_factor=low, high_freq_factor=high,
        )  # fmt: skip
    derived = max_positions / original if isinstance(max_positions, int) else 1.0
    if rope_type == "yarn":
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise UnsupportedModelError(f"{key} truncate must be true or false, got {truncate!r}")
        return RopeScaling(
            rope_type, factor=number("factor", derived) or derived, original_max_position_embeddings=original,
            beta_fast=number("beta_fast", 32.0) or 32.0, beta_slow=number("beta_slow", 1.0) or 1.0,
            truncate=truncate, mscale=number("mscale", minimum=-1),
            mscale_all_dim=number("mscale_all_dim", minimum=-1),
            attention_factor=number("attention_factor"),
        )  # fmt: skip
    return RopeScaling(  # longrope
        rope_type, factor=number("factor", derived) or derived, original_max_position_embeddings=original,
        attention_factor=number("attention_factor"),
        short_factor=factors("short_factor"), long_factor=factors("long_factor"),
    )  # fmt: skip
