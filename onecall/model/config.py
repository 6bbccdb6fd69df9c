"""ModelConfig: the hyperparameters of a dense decoder (Llama, Qwen2, Qwen3).

Built from a Hugging Face config.json dict by `ModelConfig.from_hf_config`,
which refuses (UnsupportedModelError) anything our model code would run
silently wrong: other architectures, scaled or partial RoPE, sliding windows,
activations other than SiLU, MLP biases. Names follow Hugging Face
(`hidden_size`, `num_key_value_heads`, ...) so no translation table is needed.

The three families differ only by two flags:

| family | attention_bias (q/k/v bias) | o_proj bias      | qk_norm |
|--------|-----------------------------|------------------|---------|
| llama  | config `attention_bias`     | = attention_bias | no      |
| qwen2  | always True                 | never            | no      |
| qwen3  | config `attention_bias`     | = attention_bias | yes     |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from onecall.errors import UnsupportedModelError

# Hugging Face class name -> our architecture name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED = tuple(ARCHITECTURES.values())

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# transformers' defaults for the keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only model; validated when built."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"model config {name} must be a positive integer, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UnsupportedModelError(f"model config {name} must be a positive number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def o_proj_bias(self) -> bool:
        """Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 never does."""
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + 2 * d * self.qk_norm
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict; refuse what we would run wrong."""
        # 1. Architecture, from "architectures" first, else "model_type".
        arch = _architecture(d)
        # 2. Required keys, all named at once.
        missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise UnsupportedModelError(f"model config is missing required keys: {', '.join(missing)}")
        # 3. Features we do not implement: refuse rather than run silently wrong.
        _check_unsupported_features(d, arch)
        # 4. Defaults as transformers applies them.
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            # transformers' Qwen3Config defaults head_dim to 128; Llama/Qwen2 derive it.
            head_dim = 128 if arch == "qwen3" else _int_div(d["hidden_size"], num_heads)
        num_kv_heads = d.get("num_key_value_heads")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(d, "rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
            rope_theta=_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
        )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        name = archs[0]
        if name not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        return ARCHITECTURES[name]
    model_type = d.get("model_type")
    if model_type is None:
        raise UnsupportedModelError(
            "model config names no architecture (neither 'architectures' nor 'model_type')"
        )
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return str(model_type)


def _check_unsupported_features(d: dict[str, Any], arch: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' is")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise UnsupportedModelError(f"{key} must be a dict or null, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(
                f"{key} with rope_type {rope_type!r} is not supported; only default (unscaled) RoPE is"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(
                f"{key} partial_rotary_factor {rope['partial_rotary_factor']!r} is not supported; only 1.0 is"
            )
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {d['partial_rotary_factor']!r} is not supported; only 1.0 is"
        )
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias true is not supported; only bias-free MLPs are")
    if arch in ("qwen2", "qwen3"):
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"use_sliding_window true (sliding_window {d.get('sliding_window')!r}) is not supported; "
                "only full attention is"
            )
        other = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if other:
            raise UnsupportedModelError(f"layer_types {other!r} are not supported; only 'full_attention' is")


def _rope_theta(d: dict[str, Any]) -> float:
    """rope_parameters["rope_theta"] (transformers 5) wins over top-level rope_theta (older files)."""
    params = d.get("rope_parameters") or {}
    if params.get("rope_theta") is not None:
        return _number(params, "rope_theta", _DEFAULT_ROPE_THETA)
    return _number(d, "rope_theta", _DEFAULT_ROPE_THETA)


def _number(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedModelError(f"model config {key} must be a number, got {value!r}")
    return float(value)


def _int_div(hidden_size: Any, num_heads: Any) -> int:
    if not isinstance(hidden_size, int) or not isinstance(num_heads, int) or num_heads <= 0:
        raise UnsupportedModelError(
            f"hidden_size ({hidden_size!r}) and num_attention_heads ({num_heads!r}) must be positive integers"
        )
    if hidden_size % num_heads:
        raise UnsupportedModelError(
            f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) "
            "and the config gives no head_dim"
        )
    return hidden_size // num_heads
