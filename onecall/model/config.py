"""ModelConfig: the hyperparameters of a decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3,
Qwen3-MoE, Mixtral).

Built from a Hugging Face config.json dict by `ModelConfig.from_hf_config`,
which refuses (UnsupportedModelError) anything our model code would run
silently wrong: other architectures, RoPE scalings we do not implement, per-layer
sliding windows (Qwen2's use_sliding_window), activations other than SiLU, MLP biases. Names follow
Hugging Face (`hidden_size`, `num_key_value_heads`, ...) so no translation table is needed.

The families differ only by flags:

| family  | attention_bias (q/k/v bias) | o_proj bias      | qk_norm | partial rotary | sliding window | checkpoint q/k/v, gate/up |
|---------|-----------------------------|------------------|---------|----------------|----------------|---------------------------|
| llama   | config `attention_bias`     | = attention_bias | no      | no             | no             | separate                  |
| mistral | never                       | never            | no      | no             | config (4096)  | separate                  |
| qwen2   | always True                 | never            | no      | no             | no             | separate                  |
| qwen3   | config `attention_bias`     | = attention_bias | yes     | no             | no             | separate                  |
| phi3    | never                       | never            | no      | yes            | config         | fused (qkv_proj, gate_up) |

Gemma 2/3 carry a GemmaSpec (model/gemma.py: four norms, gelu, caps, per-layer-type RoPE) and
Qwen3-MoE / Mixtral a MoESpec (model/moe.py: which layers route to experts, and how), on top of
the Llama/Qwen3 and Mistral attention they share.

RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) is parsed into a
RopeScaling; model/rope.py turns it into the cos/sin tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from onecall.errors import UnsupportedModelError

# Hugging Face class name -> our architecture name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED = tuple(ARCHITECTURES.values())
GEMMA = ("gemma2", "gemma3")
MOE = ("qwen3_moe", "mixtral")
# config.json model_type values that name one of ours differently
_MODEL_TYPES = {"gemma3_text": "gemma3"}
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types values

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# transformers' defaults for the keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {
    "llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096, "gemma2": 8192, "gemma3": 131072,
    "qwen3_moe": 32768, "mixtral": 131072,
}  # fmt: skip
# transformers' default sliding_window where a family honours one (MistralConfig: 4096).
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "phi3": None, "mixtral": None}
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling, as config.json's `rope_scaling` / `rope_parameters` give it (model/rope.py has
    the formulas). Every field a type does not use keeps its default; `factor` is always resolved
    (yarn and longrope derive it from max_position_embeddings / original when the config omits it)."""

    rope_type: str  # one of ROPE_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope: the pretraining length
    # llama3: the smooth band between low and high frequencies, in units of the original context.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3 as a GGUF stores it (tensor rope_freqs.weight): one divisor per frequency, which
    # replaces the four numbers above. onecall's own key, not transformers'.
    freq_factors: tuple[float, ...] | None = None
    # yarn: the ramp between extrapolated and interpolated frequencies (in rotations), and whether
    # its ends are rounded to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # yarn, longrope: the cos/sin multiplier; None: derived from factor as transformers does.
    attention_factor: float | None = None
    # longrope: per-frequency divisors for contexts within / beyond the original length.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclass(frozen=True)
class GemmaSpec:
    """The Gemma-only hyperparameters (Hugging Face names; model/gemma.py runs them). Everything shared
    with Llama (shapes, rms_norm_eps, rope_theta and rope_scaling of the global layers, qk_norm for
    Gemma 3) stays in ModelConfig."""

    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    layer_types: tuple[str, ...]  # per layer: SLIDING or GLOBAL
    sliding_window: int | None  # W: a sliding layer's query at position t sees keys t - W + 1 .. t
    attn_logit_softcapping: float | None  # Gemma 2; None for Gemma 3 (transformers never applies it)
    final_logit_softcapping: float | None
    # RoPE base of the sliding layers, never scaled (Gemma 3's rope_local_base_freq); None: they share
    # the global layers' table (Gemma 2).
    rope_local_base_freq: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from to_dict()
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, GLOBAL)})
        if bad:
            raise UnsupportedModelError(
                f"layer_types {bad!r} are not supported; only {SLIDING!r} and {GLOBAL!r} are"
            )
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise UnsupportedModelError("layer_types has sliding layers but sliding_window is null")


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLPs (model/moe.py): which layers have them, and their router."""

    num_experts: int
    num_experts_per_tok: int  # top k
    moe_intermediate_size: int  # each expert's gate/up rows
    norm_topk_prob: bool  # renormalise the top k weights to sum to 1 (Mixtral always; Qwen3-MoE per config)
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP of intermediate_size

    def __post_init__(self) -> None:
        if isinstance(self.sparse_layers, list):  # from to_dict()
            object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {self.num_experts} experts"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only model; validated when built."""

    architecture: str  # one of SUPPORTED
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
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    partial_rotary_factor: float = 1.0  # phi3 (Phi-4-mini: 0.75): RoPE on the first rotary_dim of each head
    # mistral, phi3: every layer attends to its last sliding_window positions only (None: no window,
    # or one that covers the whole context)
    sliding_window: int | None = None
    gemma: GemmaSpec | None = None  # gemma2, gemma3: their own layer (model/gemma.py)
    moe: MoESpec | None = None  # qwen3_moe, mixtral: mixture-of-experts MLPs (model/moe.py)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from to_dict(): asdict flattens the nested dataclass
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in self.rope_scaling.items()}
            object.__setattr__(self, "rope_scaling", RopeScaling(**fields))
        if isinstance(self.gemma, dict):
            object.__setattr__(self, "gemma", GemmaSpec(**self.gemma))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoESpec(**self.moe))
        if (self.moe is not None) != (self.architecture in MOE):
            raise UnsupportedModelError(
                f"{self.architecture}: a MoESpec is for (and required by) {', '.join(MOE)}"
            )
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"the MoE layer list has {len(self.moe.sparse_layers)} entries for {self.num_hidden_layers} layers"
            )
        if (self.gemma is not None) != (self.architecture in GEMMA):
            raise UnsupportedModelError(
                f"{self.architecture}: a GemmaSpec is for (and required by) {', '.join(GEMMA)}"
            )
        if self.gemma is not None and len(self.gemma.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.gemma.layer_types)} entries for {self.num_hidden_layers} layers"
            )
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
        rotary_dim = self.rotary_dim
        if not 0 < rotary_dim <= self.head_dim or rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor {self.partial_rotary_factor!r} gives {rotary_dim} rotary dims of "
                f"head_dim {self.head_dim}; need an even number in 2..head_dim"
            )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def o_proj_bias(self) -> bool:
        """Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 never does (Mistral, Phi-3: no biases)."""
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + 2 * d * self.qk_norm
        dense_mlp = 3 * h * self.intermediate_size
        per_layer = attn + (4 if self.gemma else 2) * h
        total = self.num_hidden_layers * per_layer
        for sparse in self.moe.sparse_layers if self.moe else (False,) * self.num_hidden_layers:
            moe = self.moe
            total += (
                moe.num_experts * (3 * h * moe.moe_intermediate_size + h) if moe and sparse else dense_mlp
            )
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict; refuse what we would run wrong."""
        # 1. Architecture, from "architectures" first, else "model_type".
        arch = _architecture(d)
        if arch == "gemma3":
            d = _gemma3_rope_as_one(d)
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
            # transformers' Qwen3Config defaults head_dim to 128, Gemma's to 256; the others derive it.
            head_dim = {"qwen3": 128, "gemma2": 256, "gemma3": 256, "qwen3_moe": 128}.get(arch) or _int_div(
                d["hidden_size"], num_heads
            )
        num_kv_heads = d.get("num_key_value_heads")
        max_positions = d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
        # 5. What depends on the context length and head size: the window, partial rotary, RoPE scaling.
        sliding_window = _sliding_window(d, arch, max_positions)
        partial_rotary_factor = _partial_rotary_factor(d, arch)
        rotary_dim = int(head_dim * partial_rotary_factor) if isinstance(head_dim, int) else 0
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
            rope_theta=_rope_theta(d, 1e6 if arch == "gemma3" else _DEFAULT_ROPE_THETA),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA)),
            attention_bias=_attention_bias(d, arch),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            rope_scaling=_rope_scaling(d, arch, max_positions, rotary_dim),
            partial_rotary_factor=partial_rotary_factor,
            sliding_window=sliding_window,
            gemma=_gemma_spec(d, arch) if arch in GEMMA else None,
            moe=_moe_spec(d, arch) if arch in MOE else None,
        )


def _moe_spec(d: dict[str, Any], arch: str) -> MoESpec:
    """transformers' Qwen3MoeConfig / MixtralConfig: Qwen3-MoE's layer i is sparse unless it is in
    mlp_only_layers or (i + 1) % decoder_sparse_step != 0; Mixtral's are all sparse, its experts as
    wide as intermediate_size, their top-2 always renormalised."""
    n = d["num_hidden_layers"]
    if arch == "mixtral":
        return MoESpec(
            num_experts=d.get("num_local_experts", 8),
            num_experts_per_tok=d.get("num_experts_per_tok", 2),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=(True,) * n,
        )
    # config.json says num_experts; transformers' to_dict writes num_local_experts (its attribute_map)
    num_experts = d.get("num_experts", d.get("num_local_experts", 128))
    step = d.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise UnsupportedModelError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    only_mlp = set(d.get("mlp_only_layers") or ())
    sparse = tuple(i not in only_mlp and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return MoESpec(
        num_experts=num_experts,
        num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _gemma3_rope_as_one(d: dict[str, Any]) -> dict[str, Any]:
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


def _gemma_spec(d: dict[str, Any], arch: str) -> GemmaSpec:
    """transformers' Gemma2Config / Gemma3TextConfig defaults; layer_types derived as they derive it
    when the file has none (Gemma 2: even layers slide; Gemma 3: all but every sliding_window_pattern-th)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        if arch == "gemma2":
            types = [SLIDING if i % 2 == 0 else GLOBAL for i in range(n)]
        else:
            types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    window = d.get("sliding_window", 4096)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise UnsupportedModelError(f"sliding_window must be a positive integer or null, got {window!r}")
    gemma2 = arch == "gemma2"
    return GemmaSpec(
        query_pre_attn_scalar=_number(d, "query_pre_attn_scalar", 256.0),
        layer_types=tuple(types),
        sliding_window=window,
        # Gemma 3: transformers keeps the key but never applies it
        attn_logit_softcapping=_optional_number(d, "attn_logit_softcapping", 50.0) if gemma2 else None,
        final_logit_softcapping=_optional_number(d, "final_logit_softcapping", 30.0 if gemma2 else None),
        rope_local_base_freq=None if gemma2 else _number(d, "rope_local_base_freq", 10000.0),
    )


def _optional_number(d: dict[str, Any], key: str, default: float | None) -> float | None:
    """d[key] (a positive number), None when the file says null, `default` when it says nothing."""
    if key in d and d[key] is None:
        return None
    value = default if d.get(key) is None else _number(d, key, 0.0)
    if value is not None and not value > 0:
        raise UnsupportedModelError(f"model config {key} must be a positive number or null, got {value!r}")
    return value


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
    model_type = _MODEL_TYPES.get(model_type, model_type)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return str(model_type)


def _attention_bias(d: dict[str, Any], arch: str) -> bool:
    if arch == "qwen2":
        return True
    if arch in ("mistral", "phi3", "mixtral"):  # their modules have no bias, whatever the config says
        return False
    return bool(d.get("attention_bias", False))


def _check_unsupported_features(d: dict[str, Any], arch: str) -> None:
    # Gemma's key is hidden_activation (hidden_act in older files); gelu with the tanh approximation
    wanted = "gelu_pytorch_tanh" if arch in GEMMA else "silu"
    key = "hidden_activation" if d.get("hidden_activation") is not None else "hidden_act"
    act = d.get(key) or wanted
    if act != wanted:
        raise UnsupportedModelError(f"{key} {act!r} is not supported for {arch}; only {wanted!r} is")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention true (an embedding model) is not supported")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias true is not supported; only bias-free MLPs are")
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"use_sliding_window true (sliding_window {d.get('sliding_window')!r}) is not supported; "
                "only full attention is"
            )
        other = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if other:
            raise UnsupportedModelError(f"layer_types {other!r} are not supported; only 'full_attention' is")


def _sliding_window(d: dict[str, Any], arch: str, max_positions: int) -> int | None:
    """Mistral and Phi-3 attend within `sliding_window` tokens in every layer (the attention's
    per-layer window, model/attention.py). A window at least as long as the context never excludes a
    key: plain causal attention, None."""
    if arch not in _DEFAULT_SLIDING_WINDOW:
        return None
    window = d.get("sliding_window", _DEFAULT_SLIDING_WINDOW[arch])
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise UnsupportedModelError(f"sliding_window must be a positive integer or null, got {window!r}")
    return window if isinstance(max_positions, int) and window < max_positions else None


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


def _partial_rotary_factor(d: dict[str, Any], arch: str) -> float:
    _, rope = _rope_dict(d)
    value = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if value is None or value == 1.0:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor must be a number in (0, 1], got {value!r}")
    if arch != "phi3":
        raise UnsupportedModelError(
            f"partial_rotary_factor {value!r} is not supported for {arch}; only phi3 rotates part of a head"
        )
    return float(value)


def _rope_scaling(d: dict[str, Any], arch: str, max_positions: int, rotary_dim: int) -> RopeScaling | None:
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
        if "freq_factors" in rope:  # a GGUF's rope_freqs tensor (model/checkpoint.py)
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


def _rope_theta(d: dict[str, Any], default: float = _DEFAULT_ROPE_THETA) -> float:
    """rope_parameters["rope_theta"] (transformers 5) wins over top-level rope_theta (older files)."""
    params = d.get("rope_parameters") or {}
    if params.get("rope_theta") is not None:
        return _number(params, "rope_theta", default)
    return _number(d, "rope_theta", default)


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
