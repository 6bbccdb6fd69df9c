"""ModelConfig: the hyperparameters of a decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3/4,
Qwen3-MoE, Mixtral, gpt-oss, and the hybrids Qwen3.5 / Qwen3.5-MoE / Qwen3-Next).

Built from a Hugging Face config.json dict by `model_config_from_hf` (formats/hf_config.py), which refuses (UnsupportedModelError) anything our model code would run
silently wrong: other architectures, RoPE scalings we do not implement, per-layer sliding windows
(Qwen2's use_sliding_window), other activations, MLP biases. Every dataclass here validates itself
when built, whatever built it (a dict round trip, a test). Names follow Hugging Face
(`hidden_size`, `num_key_value_heads`, ...) so no translation table is needed.

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
the Llama/Qwen3 and Mistral attention they share. The hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)
carry a LinearAttentionSpec (model/qwen35.py: which layers are Gated DeltaNet, their head shapes)
and `attn_output_gate`; the two MoE hybrids a MoESpec with a shared expert. gpt-oss carries a
GptOssSpec (model/gpt_oss.py: sliding and full layers, attention sinks, the clamped SwiGLU experts)
and a MoESpec (every layer sparse, experts as wide as intermediate_size); its q/k/v/o biases are
attention_bias.

Gemma 4 carries a Gemma4Spec (model/gemma4.py: sliding and global layers of different head shapes,
KV sharing, per-layer inputs, K = V, proportional RoPE, the MoE block); its num_key_value_heads x
head_dim is the KV cache's row, which every layer's K/V fill (Gemma4Spec.cache_width).

DeepSeek-V3 (and Kimi-K2 / GLM-4.7-Flash, same `deepseek_v3` architecture) carries a DeepseekSpec
(model/deepseek.py: multi-head latent attention, the grouped sigmoid router) and a MoESpec (its first
first_k_dense_replace layers dense, a shared expert of n_shared_experts x moe_intermediate_size). Its
cache holds one latent row per token, [c_kv | k_pe]: num_key_value_heads is 1 and head_dim half that
row (DeepseekSpec.cache_head_dim), K holding its first half and V its second, so the pool's bytes per
token are the latent's, not per-head K and V.

RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) is parsed into a
RopeScaling; model/rope.py turns it into the cos/sin tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from onecall.errors import UnsupportedModelError
from onecall.model.state_cache import LinearStateShape

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
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma4ForCausalLM": "gemma4",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
SUPPORTED = tuple(ARCHITECTURES.values())
GEMMA = ("gemma2", "gemma3")
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # linear-attention (Gated DeltaNet) and attention layers
MOE = ("qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_next", "gpt_oss", "deepseek_v3")
SHARED_EXPERT = (*HYBRID, "deepseek_v3")  # the MoE families with a shared expert beside the routed ones
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer_types values
LINEAR = "linear_attention"  # a hybrid's Gated DeltaNet layers (its other layers are GLOBAL)
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


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
class Gemma4Spec:
    """The Gemma 4 text model's hyperparameters (Hugging Face names where it has them; model/gemma4.py
    runs them). Sliding and global layers differ in head size and KV heads, so ModelConfig's
    num_key_value_heads x head_dim is not a layer's shape for Gemma 4 but the KV cache's row: wide enough
    for every layer (cache_width); a narrower layer stores each of its KV heads `kv_repeat` times so that
    its K/V fill the row exactly (model/gemma4.py: every layer's cache view stays contiguous, the rows the
    engine copies on write are whole)."""

    layer_types: tuple[str, ...]  # per layer: SLIDING or GLOBAL
    sliding_window: int  # W: a sliding layer's query at position t sees keys t - W + 1 .. t
    sliding_head_dim: int  # transformers' head_dim
    sliding_kv_heads: int  # transformers' num_key_value_heads
    global_head_dim: int
    global_kv_heads: int  # num_global_key_value_heads where attention_k_eq_v, else num_key_value_heads
    attention_k_eq_v: bool  # global layers: no v_proj, V is K's projection (before k_norm and RoPE)
    num_kv_shared_layers: (
        int  # the last this many layers reuse an earlier layer's K/V (no cache of their own)
    )
    hidden_size_per_layer_input: int  # per-layer embeddings' width; 0: none
    vocab_size_per_layer_input: int
    use_double_wide_mlp: bool  # the KV-sharing layers' MLPs are 2 x intermediate_size wide
    final_logit_softcapping: float | None
    # RoPE per layer type: theta, the proportion of each head's pairs rotated (transformers'
    # "proportional" type: the others pass through), and the factor dividing every frequency
    sliding_rope_theta: float = 10000.0
    global_rope_theta: float = 1000000.0
    global_rope_proportion: float = 1.0
    global_rope_factor: float = 1.0
    # the MoE block beside each layer's dense MLP (26B-A4B); 0 experts: none
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from to_dict()
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, GLOBAL)})
        if bad:
            raise UnsupportedModelError(
                f"layer_types {bad!r} are not supported; only {SLIDING!r} and {GLOBAL!r} are"
            )
        _require_positive_ints(
            self,
            "sliding_window",
            "sliding_head_dim",
            "sliding_kv_heads",
            "global_head_dim",
            "global_kv_heads",
        )
        if self.sliding_head_dim % 2 or self.global_head_dim % 2:
            raise UnsupportedModelError("Gemma 4 head sizes must be even for RoPE")
        n = len(self.layer_types)
        if not 0 <= self.num_kv_shared_layers < n:
            raise UnsupportedModelError(
                f"num_kv_shared_layers {self.num_kv_shared_layers} must be in 0 .. {n - 1} "
                "(at least one layer computes K/V)"
            )
        own = set(self.layer_types[: n - self.num_kv_shared_layers])
        if not set(self.layer_types) <= own:
            raise UnsupportedModelError(
                "num_kv_shared_layers: a layer type that reuses K/V has no earlier layer of its type computing them"
            )
        if self.num_experts and not 0 < self.top_k_experts <= self.num_experts:
            raise UnsupportedModelError(
                f"top_k_experts {self.top_k_experts} must be in 1 .. num_experts ({self.num_experts})"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise UnsupportedModelError("enable_moe_block needs a positive moe_intermediate_size")

    def head_dim(self, layer_idx: int) -> int:
        return self.global_head_dim if self.layer_types[layer_idx] == GLOBAL else self.sliding_head_dim

    def kv_heads(self, layer_idx: int) -> int:
        return self.global_kv_heads if self.layer_types[layer_idx] == GLOBAL else self.sliding_kv_heads

    @property
    def cache_width(self) -> int:
        """Floats of K (and of V) a token takes in one cache layer: the widest layer's."""
        return max(self.kv_heads(i) * self.head_dim(i) for i in range(len(self.layer_types)))

    def kv_repeat(self, layer_idx: int) -> int:
        """How many times layer `layer_idx` stores each KV head to fill a cache row (1 for the widest)."""
        return self.cache_width // (self.kv_heads(layer_idx) * self.head_dim(layer_idx))

    @property
    def num_kv_layers(self) -> int:
        """Layers that compute and store K/V: all but the last num_kv_shared_layers."""
        return len(self.layer_types) - self.num_kv_shared_layers

    def cache_layer(self, layer_idx: int) -> int:
        """The KV cache layer that layer `layer_idx` attends over: its own (it writes it), or for a
        KV-sharing layer the last layer of its type that computes K/V (transformers' "store" layer)."""
        first_shared = self.num_kv_layers
        if layer_idx < first_shared:
            return layer_idx
        kind = self.layer_types[layer_idx]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)

    def intermediate_size(self, layer_idx: int, base: int) -> int:
        """A layer's dense MLP width: double on the KV-sharing layers with use_double_wide_mlp."""
        return base * (2 if self.use_double_wide_mlp and layer_idx >= self.num_kv_layers else 1)


@dataclass(frozen=True)
class DeepseekSpec:
    """DeepSeek-V3's multi-head latent attention and router (Hugging Face names; model/deepseek.py runs
    them). q: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj when q_lora_rank is set; each head's q and
    k are qk_nope_head_dim + qk_rope_head_dim wide, its v v_head_dim; K and V come from one latent per
    token (kv_lora_rank, normed) through kv_b_proj, plus one shared roped key of qk_rope_head_dim."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the roped dims rotate as pairs (x0, x1), (x2, x3), ...
    n_group: int = 1  # the routed experts in this many groups; a token picks topk_group of them first
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this

    def __post_init__(self) -> None:
        _require_positive_ints(
            self,
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_group",
            "topk_group",
        )
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q <= 0):
            raise UnsupportedModelError(
                f"model config q_lora_rank must be a positive integer or null, got {q!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(
                f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}"
            )
        if self.topk_group > self.n_group:
            raise UnsupportedModelError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise UnsupportedModelError(f"routed_scaling_factor must be a positive number, got {factor!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Floats one token keeps per layer: its normed c_kv then its roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The pool's head_dim (one KV head): half the latent row (K holds the first half, V the rest),
        rounded up to even (ModelConfig wants an even head_dim)."""
        half = -(-self.latent_width // 2)
        return half + half % 2


@dataclass(frozen=True)
class GptOssSpec:
    """The gpt-oss-only hyperparameters (Hugging Face names; model/gpt_oss.py runs them): which layers
    slide, and the experts' clamped SwiGLU. Attention sinks (a learned logit per head) are part of every
    gpt-oss attention layer, so they need no flag; the MoE shapes are the config's MoESpec."""

    layer_types: tuple[str, ...]  # per layer: SLIDING or GLOBAL
    sliding_window: int | None  # W: a sliding layer's query at position t sees keys t - W + 1 .. t
    swiglu_alpha: float = 1.702  # glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # gate clamped to <= limit, up to [-limit, limit]

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from to_dict()
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, GLOBAL)})
        if bad:
            raise UnsupportedModelError(
                f"layer_types {bad!r} are not supported; only {SLIDING!r} and {GLOBAL!r} are"
            )
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise UnsupportedModelError(f"sliding_window must be a positive integer or null, got {window!r}")
        if SLIDING in self.layer_types and window is None:
            raise UnsupportedModelError("layer_types has sliding layers but sliding_window is null")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UnsupportedModelError(f"model config {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLPs (model/moe.py): which layers have them, and their router."""

    num_experts: int
    num_experts_per_tok: int  # top k
    moe_intermediate_size: int  # each expert's gate/up rows
    norm_topk_prob: bool  # renormalise the top k weights to sum to 1 (Mixtral always; Qwen3-MoE per config)
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or the dense MLP of intermediate_size
    # Qwen3-Next / Qwen3.5-MoE: every token also goes through one gated MLP this wide, scaled by
    # sigmoid(shared_expert_gate(x)) (model/moe.py); 0: no shared expert
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sparse_layers, list):  # from to_dict()
            object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        _require_positive_ints(self, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
        shared = self.shared_expert_intermediate_size
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise UnsupportedModelError(
                f"model config shared_expert_intermediate_size must be a non-negative integer, got {shared!r}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {self.num_experts} experts"
            )


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A hybrid model's linear-attention (Gated DeltaNet) layers: which layers they are and their shapes
    (Hugging Face names; model/qwen35.py runs them). q and k have linear_num_key_heads heads of
    linear_key_head_dim, v linear_num_value_heads of linear_value_head_dim; each key head serves
    linear_num_value_heads // linear_num_key_heads consecutive value heads."""

    layer_types: tuple[str, ...]  # per layer: LINEAR or GLOBAL (full attention, over the paged KV cache)
    linear_conv_kernel_dim: int  # the causal depthwise conv's width over q, k and v
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from to_dict()
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, GLOBAL)})
        if bad:
            raise UnsupportedModelError(
                f"layer_types {bad!r} are not supported; only {LINEAR!r} and {GLOBAL!r} are"
            )
        for kind in (LINEAR, GLOBAL):
            if kind not in self.layer_types:
                raise UnsupportedModelError(
                    f"a hybrid model needs at least one {kind!r} layer; layer_types has none"
                )
        _require_positive_ints(
            self,
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v, [q (key_dim); k (key_dim); v (value_dim)]."""
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    def cache_index(self, layer_idx: int) -> int:
        """Layer `layer_idx`'s index among the layers of its own type: a full-attention layer's in the
        paged KV cache, a linear one's in the LinearStateCache."""
        kind = self.layer_types[layer_idx]
        return self.layer_types[:layer_idx].count(kind)


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
    moe: MoESpec | None = None  # qwen3_moe, mixtral, qwen3_5_moe, qwen3_next: MoE MLPs (model/moe.py)
    # qwen3_5, qwen3_5_moe, qwen3_next: the Gated DeltaNet layers (model/qwen35.py)
    linear_attention: LinearAttentionSpec | None = None
    # the hybrids' full attention: o_proj reads attention * sigmoid(x W_gate^T), a gate per head and dim
    attn_output_gate: bool = False
    gpt_oss: GptOssSpec | None = None  # gpt_oss: its own layer (model/gpt_oss.py)
    # gemma4: its own layers and model part (model/gemma4.py); num_key_value_heads x head_dim is then
    # the KV cache's row (Gemma4Spec.cache_width), not a layer's shape
    gemma4: Gemma4Spec | None = None
    # deepseek_v3: multi-head latent attention and its router (model/deepseek.py); num_key_value_heads
    # (1) x head_dim (DeepseekSpec.cache_head_dim) is then half the latent row the cache holds per token
    deepseek: DeepseekSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from to_dict(): asdict flattens the nested dataclass
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in self.rope_scaling.items()}
            object.__setattr__(self, "rope_scaling", RopeScaling(**fields))
        if isinstance(self.gemma, dict):
            object.__setattr__(self, "gemma", GemmaSpec(**self.gemma))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoESpec(**self.moe))
        if isinstance(self.linear_attention, dict):
            object.__setattr__(self, "linear_attention", LinearAttentionSpec(**self.linear_attention))
        if isinstance(self.gpt_oss, dict):
            object.__setattr__(self, "gpt_oss", GptOssSpec(**self.gpt_oss))
        if isinstance(self.gemma4, dict):
            object.__setattr__(self, "gemma4", Gemma4Spec(**self.gemma4))
        if isinstance(self.deepseek, dict):
            object.__setattr__(self, "deepseek", DeepseekSpec(**self.deepseek))
        if (self.deepseek is not None) != (self.architecture == "deepseek_v3"):
            raise UnsupportedModelError(
                f"{self.architecture}: a DeepseekSpec is for (and required by) deepseek_v3"
            )
        if self.deepseek is not None:
            self._check_deepseek(self.deepseek)
        if (self.gemma4 is not None) != (self.architecture == "gemma4"):
            raise UnsupportedModelError(f"{self.architecture}: a Gemma4Spec is for (and required by) gemma4")
        if self.gemma4 is not None:
            self._check_gemma4(self.gemma4)
        if (self.gpt_oss is not None) != (self.architecture == "gpt_oss"):
            raise UnsupportedModelError(f"{self.architecture}: a GptOssSpec is for (and required by) gpt_oss")
        if self.gpt_oss is not None and len(self.gpt_oss.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.gpt_oss.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.gpt_oss is not None and (
            self.moe is None
            or not all(self.moe.sparse_layers)
            or self.qk_norm
            or self.partial_rotary_factor != 1.0
            or self.sliding_window is not None
        ):
            raise UnsupportedModelError(
                "gpt_oss: every layer's MLP is MoE, no q/k norm, full rotary, and its window is per layer "
                "(GptOssSpec.sliding_window, not sliding_window)"
            )
        if (self.linear_attention is not None) != (self.architecture in HYBRID):
            raise UnsupportedModelError(
                f"{self.architecture}: a LinearAttentionSpec is for (and required by) {', '.join(HYBRID)}"
            )
        if (
            self.linear_attention is not None
            and len(self.linear_attention.layer_types) != self.num_hidden_layers
        ):
            raise UnsupportedModelError(
                f"layer_types has {len(self.linear_attention.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.attn_output_gate and self.architecture not in HYBRID:
            raise UnsupportedModelError(
                f"{self.architecture}: attn_output_gate is implemented for {', '.join(HYBRID)} only"
            )
        if (
            self.moe is not None
            and self.moe.shared_expert_intermediate_size
            and self.architecture not in SHARED_EXPERT
        ):
            raise UnsupportedModelError(
                f"{self.architecture}: a shared expert is implemented for {', '.join(SHARED_EXPERT)} only"
            )
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
        _require_positive_ints(
            self,
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
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

    def _check_gemma4(self, spec: Gemma4Spec) -> None:
        if len(spec.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(spec.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if self.num_key_value_heads * self.head_dim != spec.cache_width:
            raise UnsupportedModelError(
                f"gemma4: num_key_value_heads x head_dim ({self.num_key_value_heads} x {self.head_dim}) must be "
                f"the KV cache row, {spec.cache_width} floats"
            )
        for i in range(self.num_hidden_layers):
            kv_heads, head_dim = spec.kv_heads(i), spec.head_dim(i)
            stored = spec.cache_width // head_dim  # KV heads the layer's cache view has
            if spec.cache_width % (kv_heads * head_dim) or self.num_attention_heads % stored:
                raise UnsupportedModelError(
                    f"gemma4: layer {i}'s {kv_heads} KV heads of {head_dim} do not tile the KV cache row of "
                    f"{spec.cache_width} floats into KV heads its {self.num_attention_heads} query heads share"
                )
        if (
            self.moe is not None
            or self.qk_norm
            or self.sliding_window is not None
            or self.rope_scaling is not None
        ):
            raise UnsupportedModelError(
                "gemma4: its MoE block, q/k/v norms, sliding window and RoPE are Gemma4Spec's"
            )

    def _check_deepseek(self, spec: DeepseekSpec) -> None:
        if (self.num_key_value_heads, self.head_dim) != (1, spec.cache_head_dim):
            raise UnsupportedModelError(
                f"deepseek_v3: the KV cache holds one latent row a token: num_key_value_heads 1 and head_dim "
                f"{spec.cache_head_dim} (half of {spec.latent_width}), got {self.num_key_value_heads} x {self.head_dim}"
            )
        if (
            self.moe is None
            or self.qk_norm
            or self.sliding_window is not None
            or self.partial_rotary_factor != 1.0
            or (self.rope_scaling is not None and self.rope_scaling.rope_type != "yarn")
        ):
            raise UnsupportedModelError(
                "deepseek_v3: needs its MoESpec; no q/k norm, sliding window or partial rotary; RoPE plain or yarn"
            )
        if self.moe.num_experts % spec.n_group or self.moe.num_experts // spec.n_group < 2:
            raise UnsupportedModelError(
                f"deepseek_v3: {self.moe.num_experts} routed experts do not split into {spec.n_group} groups of "
                "at least 2 (each group is scored by its top 2)"
            )
        if self.moe.num_experts_per_tok > spec.topk_group * (self.moe.num_experts // spec.n_group):
            raise UnsupportedModelError(
                f"deepseek_v3: num_experts_per_tok {self.moe.num_experts_per_tok} exceeds the experts of "
                f"{spec.topk_group} groups"
            )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K and V in the paged cache (a hybrid model's full-attention layers only):
        what the KV pool is sized by."""
        if self.gemma4 is not None:  # the KV-sharing layers attend over earlier layers' K/V
            return self.gemma4.num_kv_layers
        spec = self.linear_attention
        return self.num_hidden_layers if spec is None else self.num_hidden_layers - spec.num_linear_layers

    @property
    def linear_state_shape(self) -> LinearStateShape | None:
        """A hybrid model's per-sequence linear-attention state (model/state_cache.py); None for a
        model whose every layer is attention."""
        spec = self.linear_attention
        if spec is None:
            return None
        return LinearStateShape(
            num_layers=spec.num_linear_layers,
            conv_dim=spec.conv_dim,
            conv_width=spec.linear_conv_kernel_dim - 1,
            num_v_heads=spec.linear_num_value_heads,
            k_head_dim=spec.linear_key_head_dim,
            v_head_dim=spec.linear_value_head_dim,
        )

    @property
    def o_proj_bias(self) -> bool:
        """Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2 never does (Mistral, Phi-3: no biases)."""
        return self.attention_bias and self.architecture != "qwen2"

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        if self.gemma4 is not None:
            return self._gemma4_parameters(self.gemma4)
        if self.deepseek is not None:
            return self._deepseek_parameters(self.deepseek)
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h
        attn += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + 2 * d * self.qk_norm
        attn += h * q * self.attn_output_gate
        attn += self.num_attention_heads * (self.gpt_oss is not None)  # gpt-oss: one sink per head
        dense_mlp = 3 * h * self.intermediate_size
        norms = (4 if self.gemma else 2) * h
        spec = self.linear_attention
        mixers = [attn] * self.num_hidden_layers
        if spec is not None:  # Gated DeltaNet: in_proj [qkv; z; b; a], conv, A_log, dt_bias, norm, out_proj
            v_heads = spec.linear_num_value_heads
            linear = (
                h * (spec.conv_dim + spec.value_dim + 2 * v_heads)
                + spec.conv_dim * spec.linear_conv_kernel_dim
            )
            linear += 2 * v_heads + spec.linear_value_head_dim + spec.value_dim * h
            mixers = [linear if t == LINEAR else attn for t in spec.layer_types]
        total = sum(mixers) + self.num_hidden_layers * norms
        for sparse in self.moe.sparse_layers if self.moe else (False,) * self.num_hidden_layers:
            moe = self.moe
            total += (
                moe.num_experts * (3 * h * moe.moe_intermediate_size + h)
                + (
                    3 * h * moe.shared_expert_intermediate_size + h
                    if moe.shared_expert_intermediate_size
                    else 0
                )
                if moe and sparse
                else dense_mlp
            )
            if moe and sparse and self.gpt_oss is not None:  # expert biases (gate_up, down), router bias
                total += moe.num_experts * (2 * moe.moe_intermediate_size + h + 1)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    def _gemma4_parameters(self, spec: Gemma4Spec) -> int:
        """num_parameters of a Gemma 4 model (layer_scalar, a buffer in transformers, counted too)."""
        h, heads, bias = self.hidden_size, self.num_attention_heads, self.attention_bias
        p, e = spec.hidden_size_per_layer_input, spec.num_experts
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if p:  # embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm
            total += (spec.vocab_size_per_layer_input + h) * self.num_hidden_layers * p + p
        for i in range(self.num_hidden_layers):
            d, kv = spec.head_dim(i), spec.kv_heads(i) * spec.head_dim(i)
            total += 2 * h * heads * d + heads * d * bias + h * bias + d  # q, o (+ biases), q_norm
            if spec.cache_layer(i) == i:  # k (and v unless K = V), k_norm
                kv_projections = 1 if spec.attention_k_eq_v and spec.layer_types[i] == GLOBAL else 2
                total += kv_projections * (h * kv + kv * bias) + d
            total += 4 * h + 3 * h * spec.intermediate_size(i, self.intermediate_size) + 1  # + layer_scalar
            if e:  # router (proj, scale, per-expert scale), experts, three more norms
                total += h * e + h + e + e * 3 * h * spec.moe_intermediate_size + 3 * h
            if p:  # per_layer_input_gate, per_layer_projection, post_per_layer_input_norm
                total += 2 * h * p + h
        return total

    def _deepseek_parameters(self, spec: DeepseekSpec) -> int:
        """num_parameters of a DeepSeek-V3 model (the router's e_score_correction_bias counted too)."""
        h, heads, bias, moe = self.hidden_size, self.num_attention_heads, self.attention_bias, self.moe
        assert moe is not None
        q = heads * spec.qk_head_dim
        attn = h * q if spec.q_lora_rank is None else h * spec.q_lora_rank + spec.q_lora_rank * (1 + q)
        attn += spec.q_lora_rank * bias if spec.q_lora_rank is not None else 0
        attn += (h + bias) * spec.latent_width + spec.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
        attn += spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + spec.v_head_dim)  # kv_b_proj
        attn += heads * spec.v_head_dim * h + h * bias  # o_proj
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for sparse in moe.sparse_layers:
            total += attn + 2 * h
            if sparse:  # router (weight, correction bias), experts, shared experts
                total += moe.num_experts * (h + 1 + 3 * h * moe.moe_intermediate_size)
                total += 3 * h * moe.shared_expert_intermediate_size
            else:
                total += 3 * h * self.intermediate_size
        return total

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _require_positive_ints(spec: object, *names: str) -> None:
    """Refuse a config whose named fields are not positive integers (bools are not integers here)."""
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UnsupportedModelError(f"model config {name} must be a positive integer, got {value!r}")
