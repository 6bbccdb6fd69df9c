"""A Hugging Face config.json dict -> ModelConfig: each family's keys, transformers' defaults where a
file leaves keys out, and a refusal (UnsupportedModelError, naming the key) for anything our model
code would run wrong. model/config.py holds the validated dataclasses this fills; the RoPE keys
(scaling types, partial rotary, Gemma 3's per-layer-type parameters) are read by formats/hf_rope_config.py.
"""

from __future__ import annotations

from typing import Any

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_rope_config import gemma3_rope_as_one, partial_rotary_from_hf, rope_scaling_from_hf
from onecall.model.config import (
    ARCHITECTURES,
    GEMMA,
    GLOBAL,
    HYBRID,
    LINEAR,
    MOE,
    SLIDING,
    SUPPORTED,
    DeepseekSpec,
    Gemma4Spec,
    GemmaSpec,
    GptOssSpec,
    LinearAttentionSpec,
    ModelConfig,
    MoESpec,
)

# Classes of the families users bring that onecall does not run, named for what they are.
_REFUSED_CLASSES = {
    "GemmaForCausalLM": "Gemma 1, whose layer (two norms, no soft-caps) onecall does not implement",
    "Gemma3nForConditionalGeneration": "Gemma 3n (per-layer embeddings, AltUp, LAuReL)",
    "Qwen2MoeForCausalLM": "Qwen1.5/Qwen2-MoE, whose shared expert onecall does not implement",
    "PhimoeForCausalLM": "Phi-3.5-MoE, whose sparsemixer router onecall does not implement",
}
# config.json model_type values that name one of ours differently
_MODEL_TYPES = {
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}

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
    "qwen3_moe": 32768, "mixtral": 131072, "qwen3_5": 32768, "qwen3_5_moe": 32768, "qwen3_next": 32768,
    "gpt_oss": 131072, "gemma4": 131072, "deepseek_v3": 4096,
}  # fmt: skip
# transformers' default sliding_window where a family honours one (MistralConfig: 4096).
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "phi3": None, "mixtral": None}
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


# Multimodal checkpoints whose language model onecall runs alone (text in, text out): the class, and
# the text model's class. Their weights are renamed and the vision tower skipped on load
# (checkpoint.language_model_tensor).
MULTIMODAL_TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",  # its vision and audio towers skipped
}
# The same for Qwen3.5's multimodal classes (every released Qwen3.5 checkpoint is one), whose tensors
# loading/weights.py renames itself (model.language_model.* -> model.*; model.visual.* and mtp.* skipped),
# so formats/checkpoint.py hands them over as they are named. transformers ties their embeddings by the
# top level's tie_word_embeddings (default false), which therefore wins over the text part's. A
# config without `architectures` names them by model_type.
_MULTIMODAL_HYBRIDS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
_MULTIMODAL_HYBRID_TYPES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def text_model_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json (MULTIMODAL_TEXT_MODELS, Qwen3.5's) -> its language model's, as a
    text-only config of that family would say it: `text_config` with the top level's
    tie_word_embeddings and token ids where the text part leaves them out (Qwen3.5: the top level's
    tie_word_embeddings always). Any other config is returned as it is."""
    archs = d.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs else None
    model_type = d.get("model_type")
    if name is None and isinstance(d.get("text_config"), dict) and isinstance(model_type, str):
        name = _MULTIMODAL_HYBRID_TYPES.get(model_type)
    text_class = None
    if isinstance(name, str):
        text_class = MULTIMODAL_TEXT_MODELS.get(name) or _MULTIMODAL_HYBRIDS.get(name)
    if text_class is None:
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{name} config has no text_config to run the language model from")
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
        if merged.get(key) is None and d.get(key) is not None:
            merged[key] = d[key]
    if name in _MULTIMODAL_HYBRIDS:
        merged["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    merged["architectures"] = [text_class]
    return merged


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json dict; refuse what we would run wrong."""
    d = text_model_config(d)  # a multimodal checkpoint: its language model
    # 1. Architecture, from "architectures" first, else "model_type".
    arch = _architecture(d)
    if arch == "gemma3":
        d = gemma3_rope_as_one(d)
    if arch == "gpt_oss":
        d = _gpt_oss_defaults(d)
    if arch == "qwen3_5_moe" and d.get("intermediate_size") is None:
        # every Qwen3.5-MoE layer is sparse: no dense MLP, whose (required) size is then never used
        d = {**d, "intermediate_size": d.get("shared_expert_intermediate_size") or 512}
    # 2. Required keys, all named at once.
    missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"model config is missing required keys: {', '.join(missing)}")
    # 3. Features we do not implement: refuse rather than run silently wrong.
    _check_unsupported_features(d, arch)
    if arch == "gemma4":
        return _gemma4_config(d)
    if arch == "deepseek_v3":
        return _deepseek_v3_config(d)
    # 4. Defaults as transformers applies them.
    num_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim is None:
        # transformers' Qwen3Config defaults head_dim to 128, Gemma's to 256; the others derive it.
        head_dim = {
            "qwen3": 128, "gemma2": 256, "gemma3": 256, "qwen3_moe": 128, "qwen3_5": 256, "qwen3_5_moe": 256,
            "qwen3_next": 256, "gpt_oss": 64,
        }.get(arch) or _int_div(d["hidden_size"], num_heads)  # fmt: skip
    num_kv_heads = d.get("num_key_value_heads")
    max_positions = d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
    # 5. What depends on the context length and head size: the window, partial rotary, RoPE scaling.
    sliding_window = _sliding_window(d, arch, max_positions)
    partial_rotary_factor = partial_rotary_from_hf(d, arch)
    rotary_dim = int(head_dim * partial_rotary_factor) if isinstance(head_dim, int) else 0
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads if num_kv_heads is None else num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(d, "rms_norm_eps", 1e-5 if arch == "gpt_oss" else _DEFAULT_RMS_NORM_EPS),
        rope_theta=_rope_theta(d, 1e6 if arch == "gemma3" else _DEFAULT_ROPE_THETA),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA)),
        attention_bias=_attention_bias(d, arch),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3", *HYBRID),
        rope_scaling=rope_scaling_from_hf(d, arch, max_positions, rotary_dim),
        partial_rotary_factor=partial_rotary_factor,
        sliding_window=sliding_window,
        gemma=_gemma_spec(d, arch) if arch in GEMMA else None,
        moe=_moe_spec(d, arch) if arch in MOE else None,
        linear_attention=_linear_attention_spec(d) if arch in HYBRID else None,
        attn_output_gate=arch in HYBRID,  # transformers' Qwen3.5 / Qwen3-Next attention always has it
        gpt_oss=_gpt_oss_spec(d) if arch == "gpt_oss" else None,
    )


# transformers' GptOssConfig: the RoPE it uses when a config.json names none (rope_theta 150000 unless
# given), and the one quantization its checkpoints ship in (expert weights as MXFP4 blocks and scales,
# which loading/weights.py dequantizes).
_GPT_OSS_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip
_GPT_OSS_QUANTIZATION = ("mxfp4",)


def _gpt_oss_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """A gpt_oss config.json with transformers' GptOssConfig defaults filled in where they differ from
    the other families': num_key_value_heads 8 when the key is absent (null: as many as the query
    heads), rope_theta 150000, YaRN (factor 32 over 4096 positions, not truncated) when the file has
    neither rope_scaling nor rope_parameters, attention biases on. A quantization other than MXFP4 is
    refused by name."""
    quant = d.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method not in _GPT_OSS_QUANTIZATION:
            raise UnsupportedModelError(
                f"gpt_oss quantization_config quant_method {method!r} is not supported; only "
                f"{', '.join(_GPT_OSS_QUANTIZATION)} (dequantized on load) is"
            )
    d = dict(d)
    if "num_key_value_heads" not in d:
        d["num_key_value_heads"] = 8
    params = d.get("rope_parameters")
    if not d.get("rope_scaling") and not params:
        d["rope_parameters"] = dict(_GPT_OSS_ROPE)
    if (not isinstance(params, dict) or params.get("rope_theta") is None) and d.get("rope_theta") is None:
        d["rope_theta"] = 150000.0
    d.setdefault("attention_bias", True)
    return d


def _gpt_oss_spec(d: dict[str, Any]) -> GptOssSpec:
    """transformers' GptOssConfig defaults; layer_types derived as it derives them when the file has
    none: even layers (0, 2, ...) slide, odd ones attend to everything."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 2 else GLOBAL for i in range(n)]
    if not isinstance(types, (list, tuple)):
        raise UnsupportedModelError(f"layer_types must be a list, got {types!r}")
    return GptOssSpec(
        layer_types=tuple(types),
        sliding_window=d.get("sliding_window", 128),
        swiglu_alpha=_number(d, "swiglu_alpha", 1.702),
        swiglu_limit=_number(d, "swiglu_limit", 7.0),
    )


def _linear_attention_spec(d: dict[str, Any]) -> LinearAttentionSpec:
    """transformers' Qwen3_5TextConfig / Qwen3NextConfig defaults; layer_types derived as they derive it
    when the file has none: every full_attention_interval-th layer (default 4) full, the rest linear."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        interval = d.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise UnsupportedModelError(
                f"full_attention_interval must be a positive integer, got {interval!r}"
            )
        types = [LINEAR if (i + 1) % interval else GLOBAL for i in range(n)]
    if not isinstance(types, (list, tuple)):
        raise UnsupportedModelError(f"layer_types must be a list, got {types!r}")
    return LinearAttentionSpec(
        layer_types=tuple(types),
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=d.get("linear_key_head_dim", 128),
        linear_value_head_dim=d.get("linear_value_head_dim", 128),
        linear_num_key_heads=d.get("linear_num_key_heads", 16),
        linear_num_value_heads=d.get("linear_num_value_heads", 32),
    )


def _moe_spec(d: dict[str, Any], arch: str) -> MoESpec:
    """transformers' Qwen3MoeConfig / MixtralConfig / Qwen3NextConfig / Qwen3_5MoeTextConfig /
    GptOssConfig: Qwen3-MoE's and Qwen3-Next's layer i is sparse unless it is in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0; Mixtral's are all sparse, its experts as wide as
    intermediate_size, their top-2 always renormalised; Qwen3.5-MoE's are all sparse, renormalised too.
    gpt-oss's are all sparse, experts as wide as intermediate_size, the softmax over the top-k logits
    (the same weights as renormalising the top k of a softmax over all). Qwen3-Next and Qwen3.5-MoE add
    a shared expert to every sparse layer."""
    n = d["num_hidden_layers"]
    if arch == "gpt_oss":  # num_experts is GptOssConfig's alias of num_local_experts
        return MoESpec(
            num_experts=d.get("num_local_experts", d.get("num_experts", 128)),
            num_experts_per_tok=d.get("num_experts_per_tok", 4),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=(True,) * n,
        )
    if arch == "qwen3_5_moe":
        return MoESpec(
            num_experts=d.get("num_experts", 256),
            num_experts_per_tok=d.get("num_experts_per_tok", 8),
            moe_intermediate_size=d.get("moe_intermediate_size", 512),
            norm_topk_prob=True,  # its router renormalises whatever the config says
            sparse_layers=(True,) * n,
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 512),
        )
    if arch == "mixtral":
        return MoESpec(
            num_experts=d.get("num_local_experts", 8),
            num_experts_per_tok=d.get("num_experts_per_tok", 2),
            moe_intermediate_size=d["intermediate_size"],
            norm_topk_prob=True,
            sparse_layers=(True,) * n,
        )
    # config.json says num_experts; transformers' to_dict writes num_local_experts (its attribute_map)
    nxt = arch == "qwen3_next"
    num_experts = d.get("num_experts", d.get("num_local_experts", 512 if nxt else 128))
    step = d.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise UnsupportedModelError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    only_mlp = set(d.get("mlp_only_layers") or ())
    sparse = tuple(i not in only_mlp and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return MoESpec(
        num_experts=num_experts,
        num_experts_per_tok=d.get("num_experts_per_tok", 10 if nxt else 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 512 if nxt else 768),
        norm_topk_prob=bool(d.get("norm_topk_prob", nxt)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 512) if nxt else 0,
    )


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


def _gemma4_config(d: dict[str, Any]) -> ModelConfig:
    """transformers' Gemma4TextConfig, its defaults where the file leaves keys out: five sliding layers to
    one global (the last layer always global), global layers' head_dim global_head_dim (512) and, with
    attention_k_eq_v, num_global_key_value_heads KV heads (or as per_layer_config states them, which wins),
    RoPE per layer type (rope_parameters), per-layer inputs 256 wide unless the file says 0."""
    n, num_heads = d["num_hidden_layers"], d["num_attention_heads"]
    types = list(d.get("layer_types") or [SLIDING if (i + 1) % 6 else GLOBAL for i in range(n)])
    if types:
        types[-1] = GLOBAL  # transformers forces it (with a warning)
    head_dim, kv_heads = d.get("head_dim") or 256, d.get("num_key_value_heads") or 4
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    global_head_dim, global_kv_heads = _gemma4_global_shape(d, types, head_dim, kv_heads, k_eq_v)
    sliding_theta, global_theta, proportion, factor = _gemma4_rope(d)
    moe = bool(d.get("enable_moe_block"))
    if moe and any(d.get(k) is None for k in ("num_experts", "top_k_experts", "moe_intermediate_size")):
        raise UnsupportedModelError(
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
        )
    spec = Gemma4Spec(
        layer_types=tuple(types),
        sliding_window=d.get("sliding_window", 512),
        sliding_head_dim=head_dim,
        sliding_kv_heads=kv_heads,
        global_head_dim=global_head_dim,
        global_kv_heads=global_kv_heads,
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=d.get("num_kv_shared_layers") or 0,
        hidden_size_per_layer_input=d.get("hidden_size_per_layer_input", 256) or 0,
        vocab_size_per_layer_input=d.get("vocab_size_per_layer_input") or 262144,
        use_double_wide_mlp=bool(d.get("use_double_wide_mlp", False)),
        final_logit_softcapping=_optional_number(d, "final_logit_softcapping", None),
        sliding_rope_theta=sliding_theta,
        global_rope_theta=global_theta,
        global_rope_proportion=proportion,
        global_rope_factor=factor,
        num_experts=d["num_experts"] if moe else 0,
        top_k_experts=d["top_k_experts"] if moe else 0,
        moe_intermediate_size=d["moe_intermediate_size"] if moe else 0,
    )
    # the KV cache's row (model/gemma4.py): heads of the sliding head_dim where they tile it
    width = spec.cache_width
    cache_head_dim = next(
        (hd for hd in (head_dim, global_head_dim) if width % hd == 0 and num_heads % (width // hd) == 0),
        width,
    )
    return ModelConfig(
        architecture="gemma4",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=num_heads,
        num_key_value_heads=width // cache_head_dim,
        head_dim=cache_head_dim,
        rms_norm_eps=_number(d, "rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
        rope_theta=global_theta,
        max_position_embeddings=d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS["gemma4"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=False,  # Gemma 4's q/k/v norms are its layers' own (model/gemma4.py)
        gemma4=spec,
    )


def _deepseek_v3_config(d: dict[str, Any]) -> ModelConfig:
    """transformers' DeepseekV3Config, its defaults where the file leaves keys out (DeepSeek-V3's own
    shapes). Refused by name: a router other than noaux_tc / sigmoid scores, RoPE other than plain or
    yarn, no shared expert. The multi-token-prediction layers (model.layers.{num_hidden_layers}.*) are
    not run: loading/weights.py skips their tensors, as transformers does."""
    topk_method = d.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise UnsupportedModelError(f"deepseek_v3: topk_method {topk_method!r} is not supported; only 'noaux_tc' is")
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(f"deepseek_v3: scoring_func {scoring!r} is not supported; only 'sigmoid' is")
    # the MLA shapes decide every attention tensor's shape: a file that leaves them out is not a
    # DeepSeek-V3 config (transformers' defaults are the 671B model's), so they are required
    mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    if missing := [k for k in mla if d.get(k) is None]:
        raise UnsupportedModelError(
            f"DeepseekV3ForCausalLM config is missing its multi-head latent attention keys: {', '.join(missing)}"
        )
    n, rope_dim = d["num_hidden_layers"], d["qk_rope_head_dim"]
    max_positions = d.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS["deepseek_v3"])
    scaling = rope_scaling_from_hf(d, "deepseek_v3", max_positions, rope_dim if isinstance(rope_dim, int) else 0)
    if scaling is not None and scaling.rope_type != "yarn":
        raise UnsupportedModelError(
            f"deepseek_v3: rope_type {scaling.rope_type!r} is not supported; only the default and 'yarn' are"
        )
    shared = d.get("n_shared_experts", 1)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0:
        raise UnsupportedModelError(f"deepseek_v3: n_shared_experts {shared!r} is not supported; only 1 or more")
    dense = d.get("first_k_dense_replace", 3)
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise UnsupportedModelError(f"first_k_dense_replace must be a non-negative integer, got {dense!r}")
    inter = d.get("moe_intermediate_size", 2048)
    spec = DeepseekSpec(
        q_lora_rank=d.get("q_lora_rank", 1536),
        kv_lora_rank=d.get("kv_lora_rank", 512),
        qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=rope_dim,
        v_head_dim=d.get("v_head_dim", 128),
        rope_interleave=bool(d.get("rope_interleave", True)),
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        routed_scaling_factor=_number(d, "routed_scaling_factor", 2.5),
    )
    moe = MoESpec(
        num_experts=d.get("n_routed_experts", d.get("num_local_experts", 256)),
        num_experts_per_tok=d.get("num_experts_per_tok") or 8,
        moe_intermediate_size=inter,
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        sparse_layers=tuple(i >= dense for i in range(n)),
        shared_expert_intermediate_size=inter * shared if isinstance(inter, int) else 0,
    )
    return ModelConfig(
        architecture="deepseek_v3",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=1,  # the cache's one latent row a token (model/deepseek.py)
        head_dim=spec.cache_head_dim,
        rms_norm_eps=_number(d, "rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
        rope_theta=_rope_theta(d),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=False,
        rope_scaling=scaling,
        moe=moe,
        deepseek=spec,
    )


def _gemma4_global_shape(
    d: dict[str, Any], types: list[str], head_dim: int, kv_heads: int, k_eq_v: bool
) -> tuple[int, int]:
    """The global layers' (head_dim, KV heads)."""
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        num_global = d.get("num_global_key_value_heads")
        return d.get("global_head_dim") or 512, num_global if k_eq_v and num_global is not None else kv_heads
    if not isinstance(per_layer, dict):
        raise UnsupportedModelError(f"per_layer_config must be a mapping, got {per_layer!r}")
    shapes = set()
    for i, kind in enumerate(types):
        override = per_layer.get(str(i), per_layer.get(i)) or {}  # type: ignore[call-overload]
        if not isinstance(override, dict) or set(override) - {"head_dim", "num_key_value_heads"}:
            raise UnsupportedModelError(
                f"per_layer_config for layer {i} ({override!r}): only head_dim and num_key_value_heads are supported"
            )
        shape = (override.get("head_dim", head_dim), override.get("num_key_value_heads", kv_heads))
        if kind == SLIDING and shape != (head_dim, kv_heads):
            raise UnsupportedModelError(
                f"per_layer_config reshapes sliding layer {i}; only global layers may differ"
            )
        if kind == GLOBAL:
            shapes.add(shape)
    if len(shapes) > 1:
        raise UnsupportedModelError(
            f"per_layer_config gives the global layers different shapes: {sorted(shapes)}"
        )
    return shapes.pop() if shapes else (head_dim, kv_heads)


def _gemma4_rope(d: dict[str, Any]) -> tuple[float, float, float, float]:
    """rope_parameters per layer type -> (sliding theta, global theta, global proportion, global factor):
    the sliding layers' "default" RoPE, the global layers' "default" or "proportional"."""
    params = d.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    out = []
    for kind, allowed in ((SLIDING, ("default",)), (GLOBAL, ("default", "proportional"))):
        p = params.get(kind) if isinstance(params, dict) else None
        if not isinstance(p, dict):
            raise UnsupportedModelError(f"gemma4: rope_parameters has no {kind!r} entry: {params!r}")
        rope_type = p.get("rope_type", "default")
        if rope_type not in allowed:
            raise UnsupportedModelError(
                f"gemma4: rope_type {rope_type!r} for {kind} layers is not supported; only {', '.join(allowed)}"
            )
        proportional = rope_type == "proportional"
        out.append((
            _number(p, "rope_theta", 10000.0),
            _number(p, "partial_rotary_factor", 1.0) if proportional else 1.0,
            _number(p, "factor", 1.0) if proportional else 1.0,
        ))  # fmt: skip
    (sliding_theta, _, _), (global_theta, proportion, factor) = out
    if not 0 < proportion <= 1 or not factor > 0:
        raise UnsupportedModelError(
            "gemma4: proportional RoPE needs 0 < partial_rotary_factor <= 1 and factor > 0"
        )
    return sliding_theta, global_theta, proportion, factor


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
            what = f" ({_REFUSED_CLASSES[name]})" if name in _REFUSED_CLASSES else ""
            raise UnsupportedModelError(
                f"architecture {name!r} is not supported{what}; supported: {', '.join(ARCHITECTURES)}"
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
    # Gemma's key is hidden_activation (hidden_act in older files); gelu with the tanh approximation.
    # gpt-oss's experts run their clamped SwiGLU whatever hidden_act says (transformers never reads it).
    wanted = "gelu_pytorch_tanh" if arch in (*GEMMA, "gemma4") else "silu"
    key = "hidden_activation" if d.get("hidden_activation") is not None else "hidden_act"
    act = d.get(key) or wanted
    if act != wanted and arch != "gpt_oss":
        raise UnsupportedModelError(f"{key} {act!r} is not supported for {arch}; only {wanted!r} is")
    # Gemma 4's "vision": image tokens see each other both ways; a text-only prompt is causal
    if d.get("use_bidirectional_attention") and not (
        arch == "gemma4" and d.get("use_bidirectional_attention") == "vision"
    ):
        raise UnsupportedModelError("use_bidirectional_attention true (an embedding model) is not supported")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias true is not supported; only bias-free MLPs are")
    if arch in HYBRID and d.get("attention_bias"):
        raise UnsupportedModelError(
            f"attention_bias true is not supported for {arch}; only bias-free attention is"
        )
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
