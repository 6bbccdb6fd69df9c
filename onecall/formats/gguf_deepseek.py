"""DeepSeek-V3 from a GGUF (llama.cpp's `deepseek2` architecture), read back into the DeepseekV3Config
dict and checkpoint names it was converted from (model/deepseek.py runs it; gguf_layout.py dispatches
here, formats/gguf.py undoes the one value change: the split kv_b).

llama.cpp's converter (DeepseekV2Model, also registered for DeepseekV3ForCausalLM) writes:

| GGUF                                            | checkpoint (DeepseekV3ForCausalLM)                       |
|-------------------------------------------------|----------------------------------------------------------|
| attn_q, or attn_q_a, attn_q_a_norm, attn_q_b    | self_attn.q_proj, or q_a_proj, q_a_layernorm, q_b_proj   |
| attn_kv_a_mqa, attn_kv_a_norm                   | self_attn.kv_a_proj_with_mqa, kv_a_layernorm             |
| attn_k_b (H, rank, nope): each head's k rows    | self_attn.kv_b_proj (H * (nope + v), rank): per head     |
|   transposed; attn_v_b (H, v, rank)             |   [k rows; v rows], put back together (deepseek_kv_b)    |
| attn_kv_b (files from before the split)         | self_attn.kv_b_proj as it is                             |
| attn_output; attn_norm, ffn_norm                | self_attn.o_proj; input_ / post_attention_layernorm      |
| ffn_{gate,up,down} (the leading dense layers)   | mlp.{gate,up,down}_proj                                  |
| ffn_gate_inp, exp_probs_b.bias                  | mlp.gate.weight, mlp.gate.e_score_correction_bias        |
| ffn_{gate,up,down}_exps (E, rows, cols)         | mlp.experts.{e}.{gate,up,down}_proj ("*": per expert)    |
| ffn_{gate,up,down}_shexp                        | mlp.shared_experts.{gate,up,down}_proj                   |

and the metadata (read as llama.cpp's llama_model_deepseek2 reads it):

| deepseek2.*                                     | config.json                                              |
|-------------------------------------------------|----------------------------------------------------------|
| attention.q_lora_rank (absent: q_proj)          | q_lora_rank (null)                                       |
| attention.kv_lora_rank                          | kv_lora_rank                                             |
| attention.key_length_mla / value_length_mla     | qk_nope_head_dim + qk_rope_head_dim / v_head_dim (older  |
|   (key_length / value_length in older files)    |   files: key_length is the per-head q/k size)            |
| rope.dimension_count                            | qk_rope_head_dim; rope_interleave true (llama.cpp rotates|
|                                                 |   adjacent pairs; the converter permutes nothing)        |
| leading_dense_block_count (default 0)           | first_k_dense_replace                                    |
| feed_forward_length, expert_feed_forward_length | intermediate_size, moe_intermediate_size                 |
| expert_count, expert_used_count,                | n_routed_experts, num_experts_per_tok, n_shared_experts  |
|   expert_shared_count                           |                                                          |
| expert_group_count, expert_group_used_count     | n_group, topk_group (default 1)                          |
| expert_weights_scale (absent or 0: 1)           | routed_scaling_factor                                    |
| expert_weights_norm (absent: false)             | norm_topk_prob                                           |
| expert_gating_func 2 (sigmoid)                  | scoring_func sigmoid, topk_method noaux_tc               |
| rope.scaling.* yarn with yarn_log_multiplier    | rope_scaling yarn, mscale = mscale_all_dim = log_mul/0.1 |
|                                                 |   (gguf_rope_scaling.py; llama.cpp's cos/sin ratio is 1) |

Refused by name: softmax routing (DeepSeek-V2, or a file without expert_gating_func, which llama.cpp
reads as softmax), no routed or no shared experts, a MoE layer without its exp_probs_b.bias, attention
temperature tuning, a layer whose tensors disagree with leading_dense_block_count, kv_b in neither form.
"""

from __future__ import annotations

from typing import Any

import torch

from onecall.errors import UnsupportedModelError
from onecall.formats.ggml_types import GGUFView, checked_value
from onecall.formats.gguf_rope_scaling import rope_scaling_dict

ARCH = "deepseek2"
# the halves of kv_b_proj (attn_k_b, attn_v_b) as gguf.py receives them, before it joins them
DEEPSEEK_K_B, DEEPSEEK_V_B = "self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight"

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj", "ffn_gate_up_exps": "mlp.experts.*.gate_up_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip
# (stem, suffix) -> the whole name within the layer: the halves of kv_b, the router's bias
_SPECIAL_NAMES = {
    ("attn_k_b", "weight"): DEEPSEEK_K_B, ("attn_v_b", "weight"): DEEPSEEK_V_B,
    ("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",
}  # fmt: skip
# the projections transformers gives a bias with attention_bias (and the converter would write)
_BIASED = ("attn_q_a", "attn_kv_a_mqa", "attn_output")
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}

_KINDS = {
    **dict.fromkeys(("embedding_length", "attention.head_count", "block_count", "attention.kv_lora_rank",
                     "rope.dimension_count", "attention.q_lora_rank", "attention.key_length",
                     "attention.value_length", "attention.key_length_mla", "attention.value_length_mla",
                     "context_length", "vocab_size"), "count"),
    **dict.fromkeys(("feed_forward_length", "expert_feed_forward_length", "expert_count", "expert_used_count",
                     "expert_shared_count", "expert_group_count", "expert_group_used_count",
                     "expert_gating_func", "leading_dense_block_count"), "size"),
    **dict.fromkeys(("attention.layer_norm_rms_epsilon", "rope.freq_base", "expert_weights_scale",
                     "attention.temperature_scale"), "number"),
    "expert_weights_norm": "flag",
}  # fmt: skip
_SIGMOID, _MAX_LAYERS = 2, 4096  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID; gguf_layout's bound


def deepseek2_tensor_name(gguf_name: str) -> str:
    """A deepseek2 GGUF tensor's checkpoint name ("*" for a stacked expert index; DEEPSEEK_K_B / _V_B
    for the halves of kv_b_proj, which formats/gguf.py joins)."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        _, layer, stem, kind = parts
        special = _SPECIAL_NAMES.get((stem, kind))
        if special is not None:
            return f"model.layers.{layer}.{special}"
        if stem in _BLOCK_NAMES and (kind == "weight" or (kind == "bias" and stem in _BIASED)):
            return f"model.layers.{layer}.{_BLOCK_NAMES[stem]}.{kind}"
    elif len(parts) == 2 and parts[0] in _TOP_LEVEL and parts[1] == "weight":
        return f"{_TOP_LEVEL[parts[0]]}.weight"
    raise UnsupportedModelError(
        f"GGUF tensor {gguf_name!r} has no counterpart in onecall's deepseek2 decoder"
    )


def deepseek_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b (H, rank, nope) and attn_v_b (H, v, rank) -> kv_b_proj.weight (H * (nope + v), rank), each
    head's [k rows; v rows]: the tensor the converter split (and k_b transposed), exactly."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise UnsupportedModelError(
            f"deepseek2 GGUF: attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
            "(heads, kv_lora_rank, qk_nope) and (heads, v_head_dim, kv_lora_rank)"
        )
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])


def _key(meta: dict[str, Any], name: str, default: Any = None) -> Any:
    return checked_value(meta, f"{ARCH}.{name}", default, _KINDS[name])


def deepseek2_config(gguf: GGUFView) -> dict[str, Any]:
    """The DeepseekV3Config dict a deepseek2 GGUF was converted from (the module docstring's table).
    Phases: 1. shapes, 2. attention, 3. experts and the layer plan, 4. RoPE and token ids."""
    meta, file = gguf.metadata, gguf.path.name
    names = {t.name: t for t in gguf.tensors}

    def key(name: str, default: Any = None) -> Any:
        return _key(meta, name, default)

    # 1. shapes
    required = ("embedding_length", "attention.head_count", "block_count", "attention.kv_lora_rank",
                "rope.dimension_count", "expert_count", "expert_used_count", "expert_feed_forward_length")  # fmt: skip
    if missing := [f"{ARCH}.{name}" for name in required if key(name) is None]:
        raise UnsupportedModelError(
            f"{file} lacks {', '.join(missing)} (onecall runs deepseek2 with experts)"
        )
    hidden, heads, n, rank, rope_dim, experts, used, moe_width = (key(name) for name in required)
    if n > _MAX_LAYERS:
        raise UnsupportedModelError(
            f"GGUF key {ARCH}.block_count is {n}; onecall reads at most {_MAX_LAYERS}"
        )
    # 2. attention: llama.cpp's n_embd_head_k_mla() (key_length_mla, else key_length), n_rot the rope dims
    qk_head = key("attention.key_length_mla") or key("attention.key_length")
    v_head = key("attention.value_length_mla") or key("attention.value_length")
    if qk_head is None or v_head is None or qk_head <= rope_dim:
        raise UnsupportedModelError(
            f"{file}: deepseek2 needs attention.key_length_mla and value_length_mla (or, in older files, "
            f"key_length and value_length) with the key wider than rope.dimension_count ({rope_dim})"
        )
    if temperature := key("attention.temperature_scale"):
        raise UnsupportedModelError(
            f"GGUF key {ARCH}.attention.temperature_scale {temperature} (attention temperature tuning) "
            "is not supported"
        )
    _check_kv_b(names, n, file)
    # 3. experts and the layer plan
    gating = key("expert_gating_func")
    vocab = names["token_embd.weight"].shape[0] if "token_embd.weight" in names else key("vocab_size")
    if gating is None and n in (47, 48) and vocab == 154880:  # llama.cpp's GLM-4.7-Flash special case
        gating = _SIGMOID
    if gating != _SIGMOID:
        raise UnsupportedModelError(
            f"GGUF key {ARCH}.expert_gating_func is {gating!r} (absent: softmax, as llama.cpp reads it): "
            "only sigmoid routing (2, DeepSeek-V3's) is supported; DeepSeek-V2's softmax router is not"
        )
    dense = key("leading_dense_block_count", 0)
    shared = key("expert_shared_count", 0)
    if shared < 1:
        raise UnsupportedModelError(f"GGUF key {ARCH}.expert_shared_count must be 1 or more, got {shared}")
    for i in range(n):
        routed = f"blk.{i}.ffn_gate_inp.weight" in names
        if routed != (i >= dense) or (routed and f"blk.{i}.exp_probs_b.bias" not in names):
            raise UnsupportedModelError(
                f"{file}: block {i} {'is' if routed else 'is not'} routed (ffn_gate_inp), but "
                f"{ARCH}.leading_dense_block_count is {dense}; every routed block needs exp_probs_b.bias"
            )
    scale = key("expert_weights_scale") or 1.0  # 0 or absent: llama.cpp does not scale
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length") or moe_width,  # unused without dense layers
        "moe_intermediate_size": moe_width,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": experts,
        "num_experts_per_tok": used,
        "n_shared_experts": shared,
        "n_group": key("expert_group_count") or 1,
        "topk_group": key("expert_group_used_count") or 1,
        "routed_scaling_factor": float(scale),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "first_k_dense_replace": dense,
        "q_lora_rank": key("attention.q_lora_rank"),
        "kv_lora_rank": rank,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head - rope_dim,
        "v_head_dim": v_head,
        "rope_interleave": True,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in names,
    }
    if config["q_lora_rank"] is None and "blk.0.attn_q_a.weight" in names:
        raise UnsupportedModelError(f"{file} has attn_q_a but no {ARCH}.attention.q_lora_rank")
    # 4. RoPE and token ids
    if (rope := rope_scaling_dict(gguf, ARCH)) is not None:
        config["rope_scaling"] = rope
    for hf_key in ("bos_token_id", "eos_token_id"):
        if (token_id := checked_value(meta, f"tokenizer.ggml.{hf_key}", None, "size")) is not None:
            config[hf_key] = token_id
    return {k: v for k, v in config.items() if v is not None or k == "q_lora_rank"}


def _check_kv_b(names: dict[str, Any], n: int, file: str) -> None:
    """Every layer's kv_b in one of the two forms llama.cpp loads: split (attn_k_b and attn_v_b) or whole."""
    for i in range(n):
        split = (f"blk.{i}.attn_k_b.weight" in names, f"blk.{i}.attn_v_b.weight" in names)
        whole = f"blk.{i}.attn_kv_b.weight" in names
        if split != (True, True) and not (split == (False, False) and whole):
            raise UnsupportedModelError(
                f"{file}: block {i} needs attn_k_b and attn_v_b (or, in older files, attn_kv_b) for kv_b_proj"
            )
