"""What llama.cpp's converter (convert_hf_to_gguf.py) writes for each family, read back: GGUF tensor
names -> Hugging Face parameter names, and `{arch}.*` metadata -> the config.json dict it came from.

| GGUF arch            | HF class                | tensors beyond Llama's                      | restored from llama.cpp's rules          |
|----------------------|-------------------------|---------------------------------------------|------------------------------------------|
| llama                | LlamaForCausalLM        | rope_freqs (llama3 RoPE)                    | Q/K rows interleaved (formats/gguf.py)     |
| llama + expert_count | MixtralForCausalLM      | ffn_gate_inp, ffn_{gate,up,down}_exps (or   | top-k renormalised; Q/K interleaved      |
|                      |                         | ffn_gate_up_exps; or, in older files,       |                                          |
|                      |                         | ffn_{gate,up,down}.E per expert)            |                                          |
| qwen2, qwen3         | Qwen2/Qwen3ForCausalLM  | q/k/v biases, attn_{q,k}_norm               |                                          |
| qwen3moe             | Qwen3MoeForCausalLM     | as Mixtral, plus attn_{q,k}_norm            | norm_topk_prob true (llama.cpp always    |
|                      |                         |                                             | renormalises); every layer routed        |
| phi3                 | Phi3ForCausalLM         | attn_qkv [q; k; v], ffn_up [gate; up],      | head_dim = hidden / heads; sliding       |
|                      |                         | rope_factors_long/short (longrope)          | window 0 = none                          |
| gemma2, gemma3       | Gemma2/3ForCausalLM     | post_attention_norm, ffn_norm (before the   | norms stored as 1 + w; no lm_head (tied);|
|                      |                         | MLP), post_ffw_norm                         | query_pre_attn_scalar, layer pattern and |
|                      |                         |                                             | Gemma 3's local RoPE base: see           |
|                      |                         |                                             | _gemma_keys                              |
| gemma4               | Gemma4ForCausalLM       | q/k norms, four norms, layer_output_scale,  | norms as stored (w, not 1 + w); per-layer|
|                      |                         | per-layer inputs (per_layer_*, inp_gate,    | head dims / KV heads, K = V, shared KV,  |
|                      |                         | proj, post_norm), MoE (ffn_gate_inp(.scale),| double-wide MLPs, proportional RoPE from |
|                      |                         | ffn_gate_up_exps, ffn_down_exps(.scale),    | rope_freqs: see _gemma4_config           |
|                      |                         | pre_ffw_norm_2, post_ffw_norm_1/_2)         |                                          |
| qwen35, qwen35moe,   | Qwen3_5ForCausalLM,     | post_attention_norm; attn_q [q_h; gate_h];  | layer types from full_attention_interval |
| qwen3next            | Qwen3_5MoeForCausalLM,  | attn_qkv, attn_gate (ssm_in: Qwen3-Next's   | (or attention.recurrent_layers); the     |
|                      | Qwen3NextForCausalLM    | older files), ssm_beta/_alpha (qwen35*) or  | DeltaNet's sizes from ssm.*; the MTP     |
|                      |                         | ssm_ba (qwen3next), ssm_a, ssm_dt.bias,     | blocks past nextn_predict_layers are     |
|                      |                         | ssm_conv1d, ssm_norm, ssm_out; MoE: experts | skipped; top-k always renormalised; the  |
|                      |                         | plus ffn_{gate,up,down}_shexp and           | values: see HybridLayout                 |
|                      |                         | ffn_gate_inp_shexp                          |                                          |
| gpt-oss              | GptOssForCausalLM       | q/k/v/o biases, post_attention_norm,        | layer types (even layers slide) and the  |
|                      |                         | attn_sinks, ffn_gate_inp(.bias) the router, | clamped SwiGLU as llama.cpp fixes them;  |
|                      |                         | ffn_{gate,up,down}_exps(.bias) (MXFP4 or    | YaRN not truncated; gate/up biases put   |
|                      |                         | float; gate and up apart, de-interleaved)   | back together: see _gpt_oss_config       |
| deepseek2            | DeepseekV3ForCausalLM   | MLA (attn_q_a/_b, attn_kv_a_mqa, attn_k_b / | formats/gguf_deepseek.py (names, config, |
|                      |                         | attn_v_b or attn_kv_b), exp_probs_b, shexp  | kv_b put back together)                  |

A stacked expert tensor (num_experts, rows, cols) maps to a name with "*" for the expert index;
formats/gguf.py yields it as one tensor per expert (the per-expert names loading/weights.py stacks).
Everything the table does not cover is refused by name: other architectures (REFUSED_ARCHITECTURES
says what the common ones are), unknown tensors, RoPE and MoE keys we would run differently. The
RoPE scaling (metadata keys and factor tensors) is read by formats/gguf_rope_scaling.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from onecall.errors import UnsupportedModelError
from onecall.formats.ggml_types import GGUFView, checked_value
from onecall.formats.gguf_deepseek import deepseek2_config, deepseek2_tensor_name
from onecall.formats.gguf_rope_scaling import _float_tensor, rope_scaling_dict
from onecall.model.config import GLOBAL, LINEAR, SLIDING

GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
# Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers beside gated full attention
HYBRID_ARCHITECTURES = frozenset({"qwen35", "qwen35moe", "qwen3next"})
SUPPORTED_ARCHITECTURES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gemma4", "gpt-oss", "deepseek2",
     *HYBRID_ARCHITECTURES}
)  # fmt: skip
# Architectures llama.cpp's converter writes that onecall does not run, each named for what it is.
REFUSED_ARCHITECTURES = {
    "clip": "a multimodal projector (mmproj) file, not a language model: pass the text model's own GGUF "
    "(onecall runs text only; Gemma 3's conversion, for one, writes its language model as a gemma3 file)",
    "gemma": "Gemma 1, whose layer (two norms, no soft-caps) onecall does not implement",
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp, LAuReL), which onecall does not implement",
    "gemma-embedding": "EmbeddingGemma, an embedding model (bidirectional attention), not a causal LM",
    "qwen2moe": "Qwen1.5/Qwen2-MoE, whose shared expert onecall does not implement (Qwen3-MoE is qwen3moe)",
    "phimoe": "Phi-3.5-MoE, whose sparsemixer router onecall does not implement",
}
_HF_CLASS = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM", "gemma4": "Gemma4ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}  # fmt: skip
# block_count's bound: per-layer lists are built from it; far above any released model's (405B Llama: 126)
_MAX_LAYERS = 4096
# config.json's model_type where it differs from the GGUF arch
_MODEL_TYPE = {
    "qwen3moe": "qwen3_moe",
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
    "qwen3next": "qwen3_next",
    "gemma4": "gemma4_text",
    "gpt-oss": "gpt_oss",
}


def check_loadable(arch: str, metadata: dict[str, Any], file_name: str) -> None:
    """Raise UnsupportedModelError naming what a GGUF is, unless onecall runs it: one part of a split
    model (split.count > 1, whatever the file is called), or an architecture we do not implement."""
    count = checked_value(metadata, "split.count", 1, "count")
    if count > 1:
        part = checked_value(metadata, "split.no", 0, "size")
        raise UnsupportedModelError(
            f"{file_name} is part {part + 1} of {count} of a split GGUF; merge the parts "
            "first (`llama-gguf-split --merge FIRST_PART OUT.gguf`) and pass the merged file"
        )
    if arch in SUPPORTED_ARCHITECTURES:
        return
    what = REFUSED_ARCHITECTURES.get(arch)
    if what is not None:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is {what}")
    raise UnsupportedModelError(
        f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
    )


# ---------------------------------------------------------------- tensor names
# GGUF tensor names -> Hugging Face parameter names (the suffix .weight/.bias is kept), as the converter
# renames them (gguf-py's TensorNameMap), per family.
_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_ATTENTION_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip
_MLP_NAMES = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma's four norms: GGUF's ffn_norm is the norm before the MLP, as in Llama, which Gemma calls pre_
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}  # fmt: skip
# Phi-3 as stored: q/k/v fused in attn_qkv (separate attn_q/k/v load too, as in llama.cpp), gate and up
# fused in ffn_up (rows [gate; up]: llama.cpp's phi3 has no ffn_gate); loading/weights.py splits both.
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# MoE blocks: the router and the stacked experts (num_experts, rows, cols). ffn_gate_up_exps (the
# converter's --fuse-gate-up-exps) holds each expert's [gate; up] rows; formats/gguf.py yields the halves.
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_up_exps": "mlp.experts.*.gate_up_proj",
    "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}  # fmt: skip
_LEGACY_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# The hybrids (HybridLayout has what the converter did to their values). gguf-py maps their
# post_attention_layernorm (the norm before the MLP) to post_attention_norm: these archs have no ffn_norm.
# attn_qkv / attn_gate are the DeltaNet's in_proj_qkv / in_proj_z (Qwen3-Next's in_proj_qkvz split so by
# the converter; ssm_in is that tensor unsplit, as converters before the split wrote it, llama.cpp's
# "legacy" path). attn_q holds q and the output gate per head ([q_h; gate_h] rows), as the checkpoint.
_HYBRID_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
}  # fmt: skip
_QWEN35_NAMES = {"ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"}
_QWEN3NEXT_NAMES = {"ssm_ba": "linear_attn.in_proj_ba", "ssm_in": "linear_attn.in_proj_qkvz"}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}  # fmt: skip
# (stem, suffix) -> the whole parameter name: A_log is written as blk.N.ssm_a, with no suffix (llama.cpp's
# SSM_A_NOSCAN), dt_bias as ssm_dt's bias (the converter renames it dt_proj.bias first)
_HYBRID_SPECIAL_NAMES = {("ssm_a", ""): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
# Gemma 4 (gguf-py's MODEL_ARCH.GEMMA4 names): Gemma 2/3's four norms, the per-layer input's three
# tensors, and the 26B-A4B MoE block beside the dense MLP (its router transformers calls router.proj)
_GEMMA4_NAMES = _GEMMA_NORMS | _ATTENTION_NAMES | _MLP_NAMES | {
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp": "router.proj",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
}  # fmt: skip
# (stem, suffix) -> the whole parameter name: tensors the converter renamed with a suffix of its own (the
# router's scale, the per-expert scale as the experts' down "scale") or whose checkpoint name has none
# (layer_scalar, the experts stacked as transformers holds them: gate_up_proj (E, 2I, H), down_proj (E, H, I))
_GEMMA4_SPECIAL_NAMES = {
    ("layer_output_scale", "weight"): "layer_scalar", ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale", ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
    ("ffn_down_exps", "weight"): "experts.down_proj",
}  # fmt: skip
_GEMMA4_TOP_LEVEL_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer", "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}  # fmt: skip
# gpt-oss (gguf-py's MODEL_ARCH.GPT_OSS names, llama.cpp's GptOssModel). The converter splits
# transformers' gate_up_proj (E, H, 2I), its columns interleaved (gate 2i, up 2i + 1), into
# ffn_gate_exps and ffn_up_exps (E, I, H) each, transposed, and its bias likewise into the two
# experts' .bias (E, I); down_proj (E, I, H) is written transposed (E, H, I). Experts' weights are
# named per expert ("*", the stacked-expert convention); the two halves of the bias come back as
# GPT_OSS_GATE_BIAS / GPT_OSS_UP_BIAS, which formats/gguf.py re-interleaves into gate_up_proj_bias.
GPT_OSS_GATE_BIAS, GPT_OSS_UP_BIAS = "mlp.experts.gate_proj_bias", "mlp.experts.up_proj_bias"
_GPT_OSS_NAMES = {
    ("attn_norm", "weight"): "input_layernorm.weight",
    ("post_attention_norm", "weight"): "post_attention_layernorm.weight",
    ("attn_sinks", "weight"): "self_attn.sinks",
    ("ffn_gate_inp", "weight"): "mlp.router.weight", ("ffn_gate_inp", "bias"): "mlp.router.bias",
    ("ffn_gate_exps", "weight"): "mlp.experts.*.gate_proj.weight",
    ("ffn_up_exps", "weight"): "mlp.experts.*.up_proj.weight",
    ("ffn_down_exps", "weight"): "mlp.experts.*.down_proj.weight",
    ("ffn_gate_exps", "bias"): GPT_OSS_GATE_BIAS, ("ffn_up_exps", "bias"): GPT_OSS_UP_BIAS,
    ("ffn_down_exps", "bias"): "mlp.experts.down_proj_bias",
    **{(stem, kind): f"{_ATTENTION_NAMES[stem]}.{kind}" for stem in ("attn_q", "attn_k", "attn_v", "attn_output")
       for kind in ("weight", "bias")},
}  # fmt: skip
# Not parameters, skipped by the weight iterator on purpose: llama-3 RoPE frequency factors and Phi-3's
# longrope factors, which gguf_config_dict reads into the config's rope_scaling instead.
SKIPPED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def block_names(architecture: str, has_experts: bool = False) -> dict[str, str]:
    """GGUF block tensor stem -> Hugging Face module name within a layer, for one architecture.
    `has_experts`: a llama file with llama.expert_count > 0 (Mixtral); qwen3moe always has them."""
    if architecture in GEMMA_ARCHITECTURES:
        return _GEMMA_NORMS | _ATTENTION_NAMES | _MLP_NAMES
    if architecture in HYBRID_ARCHITECTURES:
        mixers = _HYBRID_NAMES | _ATTENTION_NAMES
        mixers |= _QWEN3NEXT_NAMES if architecture == "qwen3next" else _QWEN35_NAMES
        return mixers | (_MLP_NAMES if architecture == "qwen35" else _MOE_NAMES | _SHARED_EXPERT_NAMES)
    names = _LLAMA_NORMS | _ATTENTION_NAMES | ({} if architecture == "qwen3moe" else _MLP_NAMES)
    if architecture == "phi3":
        del names["ffn_gate"]
        names |= _PHI3_NAMES
    if has_experts or architecture == "qwen3moe":
        names |= _MOE_NAMES
    return names


def hf_tensor_name(gguf_name: str, architecture: str = "llama", has_experts: bool = False) -> str:
    """One GGUF tensor name -> its Hugging Face parameter name ("*" for a stacked expert index)."""
    parts = gguf_name.split(".")
    is_block = len(parts) in (3, 4) and parts[0] == "blk" and parts[1].isdigit()
    if architecture == "gemma4":
        return _gemma4_tensor_name(gguf_name, parts)
    if architecture == "gpt-oss":
        return _gpt_oss_tensor_name(gguf_name, parts)
    if architecture == "deepseek2":
        return deepseek2_tensor_name(gguf_name)
    if is_block and architecture in HYBRID_ARCHITECTURES:
        special = _HYBRID_SPECIAL_NAMES.get((parts[2], parts[3] if len(parts) == 4 else ""))
        if special is not None:
            return f"model.layers.{parts[1]}.{special}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        _, layer, stem, kind = parts
        names = block_names(architecture, has_experts)
        if stem in names:
            return f"model.layers.{layer}.{names[stem]}.{kind}"
        if stem in _MOE_NAMES and architecture == "llama":
            raise UnsupportedModelError(
                f"GGUF tensor {gguf_name!r} is an expert tensor, but the file's llama.expert_count is missing or 0"
            )
    elif len(parts) == 2 and parts[0] in _TOP_LEVEL_NAMES and parts[1] in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    elif (
        len(parts) == 5 and parts[0] == "blk" and parts[3].isdigit() and has_experts and parts[4] == "weight"
    ):
        # Mixtral GGUFs from before stacked experts (llama.cpp still loads them): blk.N.ffn_gate.E.weight
        _, layer, stem, expert, _ = parts
        if stem in _LEGACY_EXPERT_NAMES:
            return f"model.layers.{layer}.mlp.experts.{expert}.{_LEGACY_EXPERT_NAMES[stem]}.weight"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in onecall's {architecture} decoder"
    )


def _gemma4_tensor_name(gguf_name: str, parts: list[str]) -> str:
    """A gemma4 GGUF tensor's checkpoint name (transformers' Gemma4ForCausalLM)."""
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        _, layer, stem, kind = parts
        special = _GEMMA4_SPECIAL_NAMES.get((stem, kind))
        if special is not None:
            return f"model.layers.{layer}.{special}"
        if kind == "weight" and stem in _GEMMA4_NAMES:
            return f"model.layers.{layer}.{_GEMMA4_NAMES[stem]}.weight"
        if stem in ("ffn_gate_exps", "ffn_up_exps"):
            raise UnsupportedModelError(
                f"GGUF tensor {gguf_name!r}: Gemma 4's experts with gate and up apart; onecall loads them as "
                "the converter writes them, fused (ffn_gate_up_exps)"
            )
    elif len(parts) == 2 and parts[1] == "weight":
        name = _GEMMA4_TOP_LEVEL_NAMES.get(parts[0]) or _TOP_LEVEL_NAMES.get(parts[0])
        if name is not None:
            return f"{name}.weight"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in onecall's gemma4 decoder")


def _gpt_oss_tensor_name(gguf_name: str, parts: list[str]) -> str:
    """A gpt-oss GGUF tensor's checkpoint name (transformers' GptOssForCausalLM, experts per expert)."""
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        name = _GPT_OSS_NAMES.get((parts[2], parts[3]))
        if name is not None:
            return f"model.layers.{parts[1]}.{name}"
        if parts[2] == "ffn_gate_up_exps":
            raise UnsupportedModelError(
                f"GGUF tensor {gguf_name!r}: gpt-oss's experts with gate and up fused; onecall loads them as "
                "llama.cpp's converter writes them, apart (ffn_gate_exps, ffn_up_exps)"
            )
    elif len(parts) == 2 and parts[1] == "weight" and parts[0] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[parts[0]]}.weight"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in onecall's gpt-oss decoder")


def gpt_oss_gate_up_bias(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """ffn_gate_exps.bias and ffn_up_exps.bias (E, I) -> transformers' gate_up_proj_bias (E, 2I), columns
    interleaved again (gate 2i, up 2i + 1): the tensor the converter split, exactly."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise UnsupportedModelError(
            f"gpt-oss GGUF: the experts' gate and up biases have shapes {tuple(gate.shape)} and "
            f"{tuple(up.shape)}; expected two equal (experts, intermediate) tensors"
        )
    return torch.stack((gate, up), dim=-1).reshape(gate.shape[0], 2 * gate.shape[1])


# ---------------------------------------------------------------- metadata -> config.json


def gguf_config_dict(gguf: GGUFView) -> dict[str, Any]:
    """The Hugging Face config.json dict a GGUF was converted from (model_config_from_hf checks it).
    Phases: 1. architecture, 2. shapes, 3. RoPE, 4. the family's own keys, 5. token ids."""
    meta, arch = gguf.metadata, gguf.architecture
    check_loadable(arch, meta, gguf.path.name)
    if arch == "gemma4":
        return _gemma4_config(gguf)
    if arch == "deepseek2":
        return deepseek2_config(gguf)
    key = key_reader(meta, arch)
    required = {name: key(name) for name in ("embedding_length", "attention.head_count", "block_count")}
    if missing := [f"{arch}.{name}" for name, value in required.items() if value is None]:
        raise UnsupportedModelError(f"{gguf.path.name} lacks {' and '.join(missing)}")
    hidden_size, num_heads, num_layers = required.values()
    if num_layers > _MAX_LAYERS:  # per-layer lists are built from it below
        raise UnsupportedModelError(
            f"GGUF key {arch}.block_count is {num_layers}; onecall reads at most {_MAX_LAYERS}"
        )
    head_dim = key("attention.key_length", hidden_size // num_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gguf.path.name}: attention key and value head sizes differ")
    names = {t.name: t for t in gguf.tensors}
    is_mixtral = arch == "llama" and bool(key("expert_count", 0))
    family = "mixtral" if is_mixtral else arch
    # the embedding's rows are the vocabulary the model has (Gemma 3's converter trims padding rows)
    embed, tokens = names.get("token_embd.weight"), meta.get("tokenizer.ggml.tokens")
    num_tokens = len(tokens) if isinstance(tokens, list) and tokens else None
    vocab_size = embed.shape[0] if embed is not None else key("vocab_size", num_tokens)
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[family]],
        "model_type": _MODEL_TYPE.get(family, family),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),  # llama.cpp's default when the key is absent
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if (rotary_dim := key("rope.dimension_count", head_dim)) != head_dim:
        config["partial_rotary_factor"] = rotary_dim / head_dim  # ModelConfig allows it for phi3 only
    if (rope_scaling := rope_scaling_dict(gguf, arch)) is not None:
        config["rope_scaling"] = rope_scaling
    if arch in GEMMA_ARCHITECTURES:
        config |= _gemma_keys(arch, key, config)
    else:
        config["hidden_act"] = "silu"
    if is_mixtral or arch == "qwen3moe":
        config |= _moe_keys(arch, key, config, names)
    if (hybrid := hybrid_layout(meta, arch)) is not None:
        config |= _hybrid_keys(hybrid, key, config, names)
    if arch == "gpt-oss":
        config |= _gpt_oss_keys(gguf, key, config, names)
    if arch == "phi3":
        config["sliding_window"] = key("attention.sliding_window") or None  # the converter writes 0 for none
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if (token_id := checked_value(meta, f"tokenizer.ggml.{gguf_key}", None, "size")) is not None:
            config[hf_key] = token_id
    return {k: v for k, v in config.items() if v is not None or k in _NULLABLE}


# keys whose None means "none" (not "absent": hf_config would apply transformers' default)
_NULLABLE = frozenset({"sliding_window", "attn_logit_softcapping", "final_logit_softcapping"})


# What each `{arch}.*` key read here holds: key_reader refuses any other value by name, so a hostile or
# corrupt file cannot reach a division, a range() or a comparison with a string or a zero.
_KEY_KINDS = {
    **dict.fromkeys(("embedding_length", "attention.head_count", "attention.head_count_kv",
                     "attention.key_length", "attention.value_length", "block_count", "context_length",
                     "vocab_size", "rope.dimension_count", "attention.sliding_window_pattern",
                     "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                     "ssm.inner_size", "full_attention_interval", "attention.key_length_swa",
                     "attention.value_length_swa", "rope.dimension_count_swa"), "count"),
    **dict.fromkeys(("feed_forward_length", "expert_count", "expert_used_count", "expert_feed_forward_length",
                     "expert_shared_count", "expert_shared_feed_forward_length", "expert_gating_func",
                     "attention.sliding_window", "nextn_predict_layers", "attention.shared_kv_layers",
                     "embedding_length_per_layer_input"), "size"),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
                     "attn_logit_softcapping", "final_logit_softcapping", "expert_weights_scale"), "number"),
    "expert_weights_norm": "flag",
}  # fmt: skip


def key_reader(meta: dict[str, Any], arch: str) -> Callable[..., Any]:
    """key(name, default): the checked value of `{arch}.{name}` (kinds in _KEY_KINDS), or `default`."""

    def key(name: str, default: Any = None) -> Any:
        return checked_value(meta, f"{arch}.{name}", default, _KEY_KINDS[name])

    return key


def _gemma_keys(arch: str, key: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma rather than reading it (llama-model.cpp's load_hparams):

    - query_pre_attn_scalar: not written; llama.cpp scales scores by head_dim ** -0.5, except for the
      27B models (Gemma 2: 46 layers, Gemma 3: 62) by (hidden_size / heads) ** -0.5, as their configs say.
    - sliding layers: Gemma 2 every other layer from layer 0 (window 4096 in files without the key),
      Gemma 3 five of every six (none without a sliding_window), unless attention.sliding_window_pattern
      says another period (per-layer arrays are refused); Gemma 3's sliding layers rotate at
      rope.freq_base_swa, else 10000, unscaled.
    - soft-caps: Gemma 2's attention and final caps default to 50 and 30 (as transformers'); Gemma 3 has
      no attention cap and its final cap only when the key is written.
    """
    n, heads = config["num_hidden_layers"], config["num_attention_heads"]
    is_27b = (arch, n) in (("gemma2", 46), ("gemma3", 62))
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if is_27b else config["head_dim"],
    }
    # llama.cpp's set_swa_pattern(period): layer i slides unless i % period == period - 1
    period = key("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    # Gemma 2 files from before the key was written slide at 4096, as llama.cpp assumes for them
    window = key("attention.sliding_window", 4096 if arch == "gemma2" else None) or None
    out["sliding_window"] = window
    out["layer_types"] = [SLIDING if window and i % period < period - 1 else GLOBAL for i in range(n)]
    local_theta = key("rope.freq_base_swa")
    if arch == "gemma2":
        if local_theta not in (None, config["rope_theta"]):
            raise UnsupportedModelError("GGUF key gemma2.rope.freq_base_swa is not supported (one RoPE base)")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (value := key(cap)) is not None:
                out[cap] = value or None  # 0: no cap
    else:
        out["rope_local_base_freq"] = 10000.0 if local_theta is None else local_theta
        out["final_logit_softcapping"] = key("final_logit_softcapping") or None
    return out


def _moe_keys(
    arch: str, key: Callable[..., Any], config: dict[str, Any], names: dict[str, Any]
) -> dict[str, Any]:
    """The experts as llama.cpp runs them: softmax over every expert, the top expert_used_count,
    renormalised (llama.cpp's build_moe_ffn for llama and qwen3moe), no shared expert, no scale."""
    num_experts, top_k = key("expert_count"), key("expert_used_count")
    if not num_experts or not top_k:
        raise UnsupportedModelError(f"GGUF lacks {arch}.expert_count or {arch}.expert_used_count")
    if key("expert_gating_func") not in (None, 1):  # 1: softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE)
        raise UnsupportedModelError(
            f"GGUF key {arch}.expert_gating_func {key('expert_gating_func')!r}: only softmax"
        )
    for name, neutral in (("expert_shared_count", 0), ("expert_shared_feed_forward_length", 0),
                          ("expert_weights_scale", 1.0)):  # fmt: skip
        if key(name, neutral) != neutral:
            raise UnsupportedModelError(
                f"GGUF key {arch}.{name} (shared experts, scaled weights) is not supported"
            )
    renormalise = bool(key("expert_weights_norm", True))
    # llama.cpp routes every layer of these architectures (no dense layers: its qwen3moe has no ffn_gate)
    unrouted = [i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if unrouted or not renormalise:
        raise UnsupportedModelError(
            f"{arch} GGUF with experts: every layer must be routed (blk.{unrouted[0] if unrouted else 0}"
            ".ffn_gate_inp) and its top-k renormalised (expert_weights_norm), as llama.cpp runs it"
        )
    if arch == "llama":  # Mixtral
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
    moe_width = key("expert_feed_forward_length")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_width,
        "intermediate_size": config["intermediate_size"] or moe_width,  # unused: no dense layers
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


# ---------------------------------------------------------------- the hybrids (Qwen3.5, Qwen3-Next)
# the keys llama.cpp requires of these archs too (llama_model_qwen35*::load_arch_hparams), and what each is
_SSM_KEYS = {
    "ssm.conv_kernel": "the conv1d's width", "ssm.state_size": "the key head size",
    "ssm.group_count": "the key heads", "ssm.time_step_rank": "the value heads",
    "ssm.inner_size": "the value heads times their size",
}  # fmt: skip
# the checkpoint names whose value heads the qwen35 converter reordered, and the size of each head in them
_VALUE_HEAD_ROWS = {
    "linear_attn.in_proj_z.weight": "value", "linear_attn.in_proj_b.weight": 1,
    "linear_attn.in_proj_a.weight": 1, "linear_attn.A_log": 1, "linear_attn.dt_bias": 1,
}  # fmt: skip
_VALUE_CHANNELS = ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")  # [q; k; v]: only v's rows


@dataclass(frozen=True)
class HybridLayout:
    """A hybrid GGUF's Gated DeltaNet (its ssm.* keys), which of its layers are which, and where the
    values of its tensors differ from the checkpoint's (llama.cpp's Qwen3NextModel, and for qwen35 and
    qwen35moe its _LinearAttentionVReorderBase); formats/gguf.py undoes each difference:

    | the converter                                        | read back as                               |
    |------------------------------------------------------|--------------------------------------------|
    | ssm_a = -exp(A_log)                                  | A_log = log(-ssm_a)                        |
    | ssm_conv1d: conv1d (channels, 1, kernel) squeezed    | (channels, 1, kernel)                      |
    | every (1 + w) norm stored with the 1 added; not      | w, in float64 (as Gemma's norms: the loader|
    |   ssm_norm, the gated norm: its weight is the scale  |   adds the 1 back there, so the loaded     |
    |                                                      |   norm is the file's x bit for bit)        |
    | qwen35*, fewer key than value heads: value heads     | grouped again: rows (value_rows) of        |
    |   from grouped by key head (g0v0 .. g0v{r-1}, g1v0,  |   attn_qkv's v part, attn_gate, ssm_beta,  |
    |   ...) to tiled (g0v0, g1v0, ..., g0v1, ...)         |   ssm_alpha, ssm_a, ssm_dt, the conv's v   |
    |                                                      |   channels; columns (value_columns) of     |
    |                                                      |   ssm_out                                  |
    | qwen3next: in_proj_qkvz, rows [q_g; k_g; v_g; z_g]   | nothing: those are in_proj_qkv and _z as   |
    |   per key head g, split into attn_qkv [q; k; v] and  |   Qwen3.5 has them (v and z still grouped  |
    |   attn_gate [z], each over all heads                 |   by key head); ssm_ba is in_proj_ba as is |
    | the MTP head (mtp.*) as blocks num_layers and on     | skipped (is_mtp), as a checkpoint's mtp.*  |
    |   (nextn_predict_layers of them; older converters    |                                            |
    |   dropped it)                                        |                                            |

    The attention's q_proj ([q_h; gate_h] per head), the experts (stacked as every MoE's) and the shared
    expert keep the checkpoint's values. llama.cpp marks layer i linear unless (i + 1) is a multiple of
    full_attention_interval (default 4), or as attention.recurrent_layers says where a file has it."""

    architecture: str
    num_layers: int  # the decoder's; blocks from here on are the multi-token-prediction head
    layer_types: tuple[str, ...]  # per layer: LINEAR or GLOBAL
    plan_key: str  # the key layer_types were read from (for messages): full_attention_interval, ...
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def tiled(self) -> bool:
        """Whether the file holds the value heads tiled (qwen35, qwen35moe with fewer key than value heads)."""
        return self.architecture != "qwen3next" and self.key_heads != self.value_heads

    def is_mtp(self, gguf_name: str) -> bool:
        """Whether a GGUF tensor is the multi-token-prediction head's (a block past the decoder's)."""
        parts = gguf_name.split(".")
        return (
            len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= self.num_layers
        )

    def _grouped(self, head_dim: int) -> torch.Tensor:
        """Index that puts value heads stored tiled ((r, key heads, head_dim) flattened) back in grouped
        order ((key heads, r, head_dim)): grouped[i] = tiled[index[i]]."""
        tiled = torch.arange(self.value_heads * head_dim)
        return (
            tiled.reshape(self.value_heads // self.key_heads, self.key_heads, head_dim)
            .transpose(0, 1)
            .flatten()
        )

    def value_rows(self, hf_name: str) -> torch.Tensor | None:
        """The rows (or the elements, of a 1-D tensor) of `hf_name` as the file holds them, in the
        checkpoint's order; None where the order is the checkpoint's already."""
        if not self.tiled:
            return None
        leaf = hf_name.split(".", 3)[-1]  # "model.layers.N.linear_attn.in_proj_z.weight" -> from linear_attn
        if leaf in _VALUE_CHANNELS:
            qk = 2 * self.key_heads * self.key_head_dim
            return torch.cat((torch.arange(qk), qk + self._grouped(self.value_head_dim)))
        size = _VALUE_HEAD_ROWS.get(leaf)
        if size is None:
            return None
        return self._grouped(self.value_head_dim if size == "value" else 1)

    def value_columns(self, hf_name: str) -> torch.Tensor | None:
        """The columns of ssm_out (out_proj reads the value heads) in the checkpoint's order, or None."""
        if not self.tiled or not hf_name.endswith(".linear_attn.out_proj.weight"):
            return None
        return self._grouped(self.value_head_dim)


def hybrid_layout(meta: dict[str, Any], arch: str) -> HybridLayout | None:
    """A hybrid GGUF's HybridLayout from its metadata (None for any other architecture); a key llama.cpp
    requires of it that the file lacks, or sizes that do not divide, are an UnsupportedModelError naming
    the key."""
    if arch not in HYBRID_ARCHITECTURES:
        return None
    key = key_reader(meta, arch)
    sizes = {name: key(name) for name in ("block_count", *_SSM_KEYS)}
    if missing := [name for name, value in sizes.items() if value is None]:
        what = ", ".join(f"{arch}.{m} ({_SSM_KEYS.get(m, 'the layer count')})" for m in missing)
        raise UnsupportedModelError(f"{arch} GGUF lacks {what}, which the Gated DeltaNet layers need")
    blocks = sizes["block_count"]
    if blocks > _MAX_LAYERS:
        raise UnsupportedModelError(
            f"GGUF key {arch}.block_count is {blocks}; onecall reads at most {_MAX_LAYERS}"
        )
    num_layers = blocks - key("nextn_predict_layers", 0)
    if num_layers <= 0:
        raise UnsupportedModelError(
            f"GGUF key {arch}.nextn_predict_layers leaves no decoder layers of {blocks} blocks (an MTP-only file)"
        )
    key_heads, value_heads = sizes["ssm.group_count"], sizes["ssm.time_step_rank"]
    if value_heads % key_heads or sizes["ssm.inner_size"] % value_heads:
        raise UnsupportedModelError(
            f"GGUF keys {arch}.ssm.time_step_rank ({value_heads} value heads) must be a multiple of "
            f"{arch}.ssm.group_count ({key_heads} key heads), and {arch}.ssm.inner_size "
            f"({sizes['ssm.inner_size']}) of the value heads"
        )
    layer_types, plan_key = _layer_types(meta, arch, num_layers, blocks)
    return HybridLayout(
        architecture=arch,
        num_layers=num_layers,
        layer_types=layer_types,
        plan_key=plan_key,
        conv_kernel=sizes["ssm.conv_kernel"],
        key_heads=key_heads,
        value_heads=value_heads,
        key_head_dim=sizes["ssm.state_size"],
        value_head_dim=sizes["ssm.inner_size"] // value_heads,
    )


def _layer_types(
    meta: dict[str, Any], arch: str, num_layers: int, blocks: int
) -> tuple[tuple[str, ...], str]:
    """llama.cpp's recurrent-layer flags: attention.recurrent_layers (one flag per block, or one for all)
    where the file has it, else every full_attention_interval-th layer full attention (default 4); and
    the key they came from."""
    name = f"{arch}.attention.recurrent_layers"
    if name in meta:
        flags = meta[name] if isinstance(meta[name], list) else [meta[name]] * blocks
        if len(flags) not in (num_layers, blocks) or not all(isinstance(f, (bool, int)) for f in flags):
            raise UnsupportedModelError(
                f"GGUF key {name} must be one flag per layer ({blocks}), got {meta[name]!r}"
            )
        return tuple(LINEAR if flag else GLOBAL for flag in flags[:num_layers]), name
    interval = key_reader(meta, arch)("full_attention_interval", 4)
    types = tuple(LINEAR if (i + 1) % interval else GLOBAL for i in range(num_layers))
    return types, f"{arch}.full_attention_interval ({interval})"


def _hybrid_keys(
    hybrid: HybridLayout, key: Callable[..., Any], config: dict[str, Any], names: dict[str, Any]
) -> dict[str, Any]:
    """The config.json keys of a hybrid: the DeltaNet's sizes and layer types; the rotary fraction always
    (transformers' default for these families is 0.25, llama.cpp's without the key the whole head); for
    qwen35moe and qwen3next the experts as llama.cpp runs them (softmax over every expert whatever
    expert_gating_func says, the top expert_used_count always renormalised, a sigmoid-gated shared expert
    in every layer, no dense layers). Each layer's tensors are checked against its type, so a file whose
    layer plan we would read wrong is refused naming the key the plan came from."""
    arch, n = hybrid.architecture, hybrid.num_layers
    for i, kind in enumerate(hybrid.layer_types):
        attention, linear = f"blk.{i}.attn_q.weight" in names, f"blk.{i}.ssm_out.weight" in names
        if kind == GLOBAL and not attention and f"blk.{i}.attn_qkv.weight" in names:
            raise UnsupportedModelError(
                f"{arch} GGUF: block {i}'s attention has q, k and v fused (attn_qkv), which onecall does not split"
            )
        if (attention, linear) != (kind == GLOBAL, kind == LINEAR):
            has = "attention" if attention else "linear attention" if linear else "neither mixer's"
            raise UnsupportedModelError(
                f"{arch} GGUF: block {i} has {has} tensors, but {hybrid.plan_key} makes it a {kind} layer"
            )
    out: dict[str, Any] = {
        "num_hidden_layers": n,
        "layer_types": list(hybrid.layer_types),
        "linear_conv_kernel_dim": hybrid.conv_kernel,
        "linear_key_head_dim": hybrid.key_head_dim,
        "linear_value_head_dim": hybrid.value_head_dim,
        "linear_num_key_heads": hybrid.key_heads,
        "linear_num_value_heads": hybrid.value_heads,
        "partial_rotary_factor": key("rope.dimension_count", config["head_dim"]) / config["head_dim"],
        "attention_bias": any(name.endswith(".attn_q.bias") for name in names),
    }
    if arch == "qwen35":
        return out
    num_experts, top_k = key("expert_count"), key("expert_used_count")
    if not num_experts or not top_k:
        raise UnsupportedModelError(f"GGUF lacks {arch}.expert_count or {arch}.expert_used_count")
    if key("expert_weights_scale") not in (None, 0.0, 1.0):  # 0: llama.cpp's "none"
        raise UnsupportedModelError(
            f"GGUF key {arch}.expert_weights_scale (scaled expert weights) is not supported"
        )
    widths = {}
    for width_key, tensor in (("expert_feed_forward_length", "ffn_down_exps"),
                              ("expert_shared_feed_forward_length", "ffn_down_shexp")):  # fmt: skip
        # without the key, the tensor's own width (llama.cpp's fallback, n_ff / n_expert_used or n_ff,
        # loads the file only where it equals that); the down projection is (.., hidden, width)
        info = names.get(f"blk.0.{tensor}.weight")
        widths[width_key] = key(width_key) or (info.shape[-1] if info is not None else None)
        if not widths[width_key]:
            raise UnsupportedModelError(f"GGUF lacks {arch}.{width_key} (and blk.0.{tensor}.weight)")
    moe_width, shared_width = widths.values()
    return out | {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_width,
        "shared_expert_intermediate_size": shared_width,
        # unused (no dense layers); Qwen3.5-MoE's config has none, hf_config then takes the shared width
        "intermediate_size": config["intermediate_size"] or (moe_width if arch == "qwen3next" else None),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


# ---------------------------------------------------------------- Gemma 4
_UNROTATED = 1e29  # a rope_freqs factor at least this large leaves its pair unrotated (the converter: 1e30)


def _gemma4_per_layer(meta: dict[str, Any], name: str, n: int, kind: str) -> list[Any] | None:
    """`gemma4.{name}`: one value for every layer or an array of one per layer (llama.cpp's
    get_key_or_arr), each checked as a `kind`; None if absent."""
    key = f"gemma4.{name}"
    if key not in meta:
        return None
    values = meta[key] if isinstance(meta[key], list) else [meta[key]] * n
    if len(values) != n:
        raise UnsupportedModelError(f"GGUF key {key} must hold one value per layer ({n}), got {len(values)}")
    return [checked_value({key: v}, key, None, kind) for v in values]


def _gemma4_config(gguf: GGUFView) -> dict[str, Any]:
    """The Gemma4TextConfig dict a gemma4 GGUF was converted from (llama.cpp's Gemma4Model, read back as
    llama.cpp's llama_model_gemma4 reads it):

    | GGUF                                               | config.json                                  |
    |----------------------------------------------------|----------------------------------------------|
    | attention.sliding_window_pattern (a flag per layer)| layer_types (the last layer must be global)  |
    | attention.key_length / key_length_swa (= value's)  | global_head_dim / head_dim                   |
    | attention.head_count_kv (per layer, or one)        | num_key_value_heads (sliding layers'); the   |
    |                                                    | global layers' as num_global_key_value_heads |
    |                                                    | with K = V, else per_layer_config            |
    | no attn_v in the global layers that compute K/V    | attention_k_eq_v (V is K's projection)       |
    | attention.shared_kv_layers                         | num_kv_shared_layers                         |
    | feed_forward_length ([n] before the shared layers, | intermediate_size n, use_double_wide_mlp     |
    |   [2n] on them, or one n)                          |                                              |
    | embedding_length_per_layer_input, the rows of      | hidden_size_per_layer_input,                 |
    |   per_layer_token_embd                             | vocab_size_per_layer_input                   |
    | rope.freq_base, rope.freq_base_swa (default: the   | rope_parameters: global proportional, the    |
    |   global base, as llama.cpp); rope_freqs.weight,   |   pairs of factor f rotated (proportion =    |
    |   f for the rotated pairs, 1e30 for the rest       |   their share, factor f: the converter       |
    |                                                    |   writes 1); sliding default                 |
    | final_logit_softcapping (only when set)            | final_logit_softcapping                      |
    | ffn_gate_inp in every layer; expert_count,         | enable_moe_block, num_experts, top_k_experts,|
    |   expert_used_count, expert_feed_forward_length    |   moe_intermediate_size                      |

    Fixed by llama.cpp, so not read: attention scale 1, gelu_tanh, softmax routing renormalised over the
    top k. Refused by name: rope.dimension_count other than the global head size, a sliding rotary
    fraction (rope.dimension_count_swa below key_length_swa), RoPE scaling keys, an attention soft-cap,
    per-layer query head counts, KV head counts or K = V that differ between layers of one type, a
    rope_freqs tensor we cannot read as proportional RoPE, an MoE block in some layers only."""
    meta, names, file = gguf.metadata, {t.name: t for t in gguf.tensors}, gguf.path.name
    key = key_reader(meta, "gemma4")
    required = {name: key(name) for name in ("embedding_length", "attention.head_count", "block_count",
                                             "attention.key_length", "attention.key_length_swa")}  # fmt: skip
    if missing := [f"gemma4.{name}" for name, value in required.items() if value is None]:
        raise UnsupportedModelError(f"{file} lacks {' and '.join(missing)}")
    hidden, heads, n, global_dim, sliding_dim = required.values()
    if n > _MAX_LAYERS:
        raise UnsupportedModelError(
            f"GGUF key gemma4.block_count is {n}; onecall reads at most {_MAX_LAYERS}"
        )
    if (key("attention.value_length", global_dim), key("attention.value_length_swa", sliding_dim)) != (
        global_dim, sliding_dim,
    ):  # fmt: skip
        raise UnsupportedModelError(f"{file}: gemma4 attention key and value head sizes differ")
    pattern = _gemma4_per_layer(meta, "attention.sliding_window_pattern", n, "flag")
    if pattern is None:
        raise UnsupportedModelError(f"{file} lacks gemma4.attention.sliding_window_pattern (the layer types)")
    types = [SLIDING if flag else GLOBAL for flag in pattern]
    if types[-1] != GLOBAL:
        raise UnsupportedModelError(
            "GGUF key gemma4.attention.sliding_window_pattern makes the last layer sliding; Gemma 4's is global"
        )
    shared = key("attention.shared_kv_layers", 0)
    if shared >= n:
        raise UnsupportedModelError(
            f"GGUF key gemma4.attention.shared_kv_layers ({shared}) leaves no KV layer"
        )
    first_shared = n - shared
    out: dict[str, Any] = {
        "architectures": [_HF_CLASS["gemma4"]],
        "model_type": _MODEL_TYPE["gemma4"],
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "head_dim": sliding_dim,
        "global_head_dim": global_dim,
        "layer_types": types,
        "num_kv_shared_layers": shared,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": key("context_length"),
        "sliding_window": key("attention.sliding_window"),
        "final_logit_softcapping": key("final_logit_softcapping") or None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
    }
    if key("attn_logit_softcapping"):
        raise UnsupportedModelError(
            "GGUF key gemma4.attn_logit_softcapping: Gemma 4's attention has no soft-cap"
        )
    out |= _gemma4_attention(meta, names, types, first_shared, heads)
    out |= _gemma4_widths(gguf, key, names, n, first_shared)
    out["rope_parameters"] = _gemma4_rope_parameters(gguf, key, global_dim, sliding_dim)
    out |= _gemma4_moe(key, names, n)
    for hf_key in ("bos_token_id", "eos_token_id"):
        if (token_id := checked_value(meta, f"tokenizer.ggml.{hf_key}", None, "size")) is not None:
            out[hf_key] = token_id
    return {k: v for k, v in out.items() if v is not None or k in _NULLABLE}


def _gemma4_attention(
    meta: dict[str, Any], names: dict[str, Any], types: list[str], first_shared: int, heads: int
) -> dict[str, Any]:
    """KV heads per layer type and K = V (the global layers computing K/V without attn_v)."""
    n = len(types)
    kv = _gemma4_per_layer(meta, "attention.head_count_kv", n, "count") or [heads] * n
    per_type = {kind: {kv[i] for i in range(n) if types[i] == kind} for kind in (SLIDING, GLOBAL)}
    if any(len(counts) > 1 for counts in per_type.values()):
        raise UnsupportedModelError(
            f"GGUF key gemma4.attention.head_count_kv {kv!r}: layers of one type with different KV head counts"
        )
    sliding_kv = next(iter(per_type[SLIDING]), None)
    global_kv = next(iter(per_type[GLOBAL]))
    if sliding_kv is None:  # no sliding layer: the sliding count is never used
        sliding_kv = global_kv
    no_v = {types[i] for i in range(first_shared) if f"blk.{i}.attn_v.weight" not in names}
    with_v = {types[i] for i in range(first_shared) if f"blk.{i}.attn_v.weight" in names}
    if SLIDING in no_v or no_v & with_v:
        raise UnsupportedModelError(
            "gemma4 GGUF: attn_v is missing from some layers only; onecall runs K = V (no attn_v) in "
            "every global layer that computes K/V, and in no sliding layer"
        )
    k_eq_v = GLOBAL in no_v
    out: dict[str, Any] = {"num_key_value_heads": sliding_kv, "attention_k_eq_v": k_eq_v}
    if global_kv != sliding_kv:
        if k_eq_v:
            out["num_global_key_value_heads"] = global_kv
        else:  # transformers keeps num_global_key_value_heads for K = V models: say it per layer
            out["per_layer_config"] = {
                str(i): {"num_key_value_heads": global_kv} for i in range(n) if types[i] == GLOBAL
            }
    return out


def _gemma4_widths(
    gguf: GGUFView, key: Callable[..., Any], names: dict[str, Any], n: int, first_shared: int
) -> dict[str, Any]:
    """The vocabularies (the embeddings' rows), the MLP width (and double-wide MLPs) and the per-layer
    input's width."""
    embed, per_layer = names.get("token_embd.weight"), names.get("per_layer_token_embd.weight")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab = embed.shape[0] if embed is not None else len(tokens) if isinstance(tokens, list) else None
    widths = _gemma4_per_layer(gguf.metadata, "feed_forward_length", n, "count")
    if widths is None:
        raise UnsupportedModelError(f"{gguf.path.name} lacks gemma4.feed_forward_length")
    width = widths[0]
    double = [width] * first_shared + [2 * width] * (n - first_shared)
    if widths not in ([width] * n, double):
        raise UnsupportedModelError(
            f"GGUF key gemma4.feed_forward_length {widths!r}: onecall runs one MLP width, doubled on the "
            "KV-sharing layers only (use_double_wide_mlp)"
        )
    per_layer_width = key("embedding_length_per_layer_input", 0)
    if per_layer_width and per_layer is None:
        raise UnsupportedModelError(f"{gguf.path.name}: per-layer inputs without per_layer_token_embd.weight")
    return {
        "vocab_size": vocab,
        "intermediate_size": width,
        "use_double_wide_mlp": widths != [width] * n,
        "hidden_size_per_layer_input": per_layer_width,
        "vocab_size_per_layer_input": per_layer.shape[0]
        if per_layer_width and per_layer is not None
        else None,
    }


def _gemma4_rope_parameters(
    gguf: GGUFView, key: Callable[..., Any], global_dim: int, sliding_dim: int
) -> dict[str, Any]:
    """Global layers: proportional RoPE, as the converter encodes it in rope_freqs (used by the global
    layers only): n_rot = the whole head, each pair's frequency divided by its factor, 1e30 for the pairs
    not rotated. Sliding layers: default RoPE over the whole head at rope.freq_base_swa."""
    meta, arch = gguf.metadata, "gemma4"
    scaling = sorted(
        k for k in meta if k.startswith(f"{arch}.rope.scaling.") or k == f"{arch}.rope.scale_linear"
    )
    if scaling and not (scaling == [f"{arch}.rope.scaling.type"] and meta[scaling[0]] == "none"):
        raise UnsupportedModelError(f"GGUF keys {', '.join(scaling)}: Gemma 4 RoPE scaling is not supported")
    if (rotated := key("rope.dimension_count", global_dim)) != global_dim:
        raise UnsupportedModelError(
            f"GGUF key gemma4.rope.dimension_count is {rotated}; Gemma 4's global layers rotate the whole "
            f"head ({global_dim}), their proportion being in rope_freqs"
        )
    if (rotated := key("rope.dimension_count_swa", sliding_dim)) != sliding_dim:
        raise UnsupportedModelError(
            f"GGUF key gemma4.rope.dimension_count_swa is {rotated}: partial RoPE in the sliding layers "
            f"(head size {sliding_dim}) is not supported"
        )
    global_theta = key("rope.freq_base", 10000.0)
    factors = _float_tensor(gguf, "rope_freqs.weight")
    if factors is None:
        raise UnsupportedModelError(f"{gguf.path.name} lacks rope_freqs.weight (the global layers' RoPE)")
    pairs = sum(1 for f in factors if f < _UNROTATED)
    kept = set(factors[:pairs])
    if (
        len(factors) != global_dim // 2
        or pairs == 0
        or any(f < _UNROTATED for f in factors[pairs:])
        or len(kept) != 1
        or not min(kept) > 0
    ):
        raise UnsupportedModelError(
            f"GGUF tensor rope_freqs.weight ({len(factors)} factors for heads of {global_dim}) is not "
            "proportional RoPE (one factor for the leading pairs, 1e30 for the rest)"
        )
    global_rope = {"rope_type": "proportional", "partial_rotary_factor": pairs / (global_dim // 2),
                   "rope_theta": global_theta}  # fmt: skip
    if (factor := kept.pop()) != 1.0:
        global_rope["factor"] = factor
    return {
        SLIDING: {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", global_theta)},
        GLOBAL: global_rope,
    }


def _gemma4_moe(key: Callable[..., Any], names: dict[str, Any], n: int) -> dict[str, Any]:
    """The MoE block (26B-A4B) in every layer or none; llama.cpp routes it by softmax over every expert,
    the top expert_used_count renormalised, then each expert scaled by its ffn_down_exps.scale."""
    routed = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not routed:
        return {"enable_moe_block": False}
    needed = ("ffn_gate_inp.scale", "ffn_down_exps.scale", "ffn_gate_up_exps.weight", "ffn_down_exps.weight",
              "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight")  # fmt: skip
    if lacking := [
        f"blk.{i}.{t}" for i in range(n) for t in needed if i not in routed or f"blk.{i}.{t}" not in names
    ]:
        raise UnsupportedModelError(
            f"gemma4 GGUF: the MoE block must be whole in every layer; it lacks {', '.join(lacking[:4])}"
        )
    num_experts, top_k = key("expert_count"), key("expert_used_count")
    if not num_experts or not top_k:
        raise UnsupportedModelError("GGUF lacks gemma4.expert_count or gemma4.expert_used_count")
    width = key("expert_feed_forward_length") or names["blk.0.ffn_down_exps.weight"].shape[-1]
    return {"enable_moe_block": True, "num_experts": num_experts, "top_k_experts": top_k,
            "moe_intermediate_size": width}  # fmt: skip


# The gpt-oss keys llama.cpp's converter writes (GptOssModel.set_gguf_parameters on TextModel's), and
# what llama.cpp fixes instead of reading (llama_model gpt-oss, its graph): every other layer slides,
# the even ones (swa pattern 2); the experts' SwiGLU clamps at 7.0 with alpha 1.702 (transformers'
# GptOssConfig defaults, which the released checkpoints keep); the router's softmax over the top k.
_GPT_OSS_SWIGLU_LIMIT = 7.0


def _gpt_oss_keys(
    gguf: GGUFView, key: Callable[..., Any], config: dict[str, Any], names: dict[str, Any]
) -> dict[str, Any]:
    """The GptOssConfig keys a gpt-oss GGUF was converted from, beyond the generic ones:

    | config.json                 | from                                                           |
    |-----------------------------|----------------------------------------------------------------|
    | intermediate_size           | expert_feed_forward_length (= feed_forward_length, as written) |
    | num_local_experts, _per_tok | expert_count, expert_used_count                                |
    | sliding_window, layer_types | attention.sliding_window; even layers sliding (llama.cpp's)   |
    | rope_scaling                | rope.scaling.* yarn (required: the converter asserts it), not  |
    |                             | truncated (the released config's truncate false)               |
    | swiglu_limit, hidden_act    | 7.0 (llama.cpp's constant); transformers never reads the act   |
    """
    file, n = gguf.path.name, config["num_hidden_layers"]
    width, expert_width = key("feed_forward_length"), key("expert_feed_forward_length")
    if width is not None and expert_width is not None and width != expert_width:
        raise UnsupportedModelError(
            f"GGUF keys gpt-oss.feed_forward_length ({width}) and expert_feed_forward_length ({expert_width}) "
            "differ; gpt-oss has only experts, one width"
        )
    experts, used = key("expert_count"), key("expert_used_count")
    window = key("attention.sliding_window")
    if (expert_width or width) is None or experts is None or used is None or not window:
        raise UnsupportedModelError(
            f"{file} lacks gpt-oss.expert_feed_forward_length, expert_count, expert_used_count or "
            "attention.sliding_window"
        )
    if not 0 < used <= experts:
        raise UnsupportedModelError(f"GGUF key gpt-oss.expert_used_count {used} is not in 1..{experts}")
    rope = config.get("rope_scaling")
    if rope is None or rope.get("rope_type") != "yarn":
        raise UnsupportedModelError(
            f"{file}: gpt-oss's RoPE is YaRN (rope.scaling.type yarn, as llama.cpp's converter writes it); "
            f"got {rope!r}"
        )
    for required in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "attn_sinks.weight"):
        if f"blk.0.{required}" not in names:
            raise UnsupportedModelError(f"{file}: gpt-oss GGUF lacks blk.0.{required}")
    return {
        "intermediate_size": expert_width or width,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "sliding_window": window,
        "layer_types": [SLIDING if i % 2 == 0 else GLOBAL for i in range(n)],
        "rope_scaling": {"truncate": False, **rope},
        "swiglu_limit": _GPT_OSS_SWIGLU_LIMIT,
    }
