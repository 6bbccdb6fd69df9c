"""Tiny random-weight models on disk, for tests: HF safetensors folders and GGUF files.

    config = tiny_hf_config("qwen3")
    state = random_state_dict(config, seed=0)
    write_tiny_hf_folder(tmp_path / "hf", state, config, shards=2)
    write_tiny_gguf(tmp_path / "m.gguf", state, config, extra_metadata={"tokenizer.ggml.model": "gpt2", ...})

The GGUF writer follows llama.cpp's convert_hf_to_gguf.py: HF names -> GGUF names,
llama's Q/K rows permuted into GGML's interleaved RoPE layout, norms kept in F32,
metadata under `{arch}.*`. It is written independently of onecall's loader (the
direction is the converter's, HF -> GGUF) so round trips through the loader test it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import save_file

if TYPE_CHECKING:
    from onecall.model.decoder import DecoderLM

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# HF module name (without "model.layers.N.") -> GGUF block tensor stem, as the converter names them.
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}


def tiny_hf_config(architecture: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A config.json dict for a 2-layer model small enough to run in milliseconds.

    qwen3 gets head_dim 16 != hidden_size / num_attention_heads (8), as real Qwen3 models do.
    """
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[architecture]],
        "model_type": architecture,
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16 if architecture == "qwen3" else 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": architecture == "qwen2",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if architecture == "qwen2":
        del config["attention_bias"]  # Qwen2 always has q/k/v biases; its config has no such key
    config.update(overrides)
    return config


def random_state_dict(config: Mapping[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 parameters for `config` (names as transformers' *ForCausalLM state_dict)."""
    gen = torch.Generator().manual_seed(seed)
    arch = config["model_type"]
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    qkv_bias = arch == "qwen2" or bool(config.get("attention_bias"))

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    def norm(size: int) -> torch.Tensor:
        return 1.0 + torch.randn(size, generator=gen) * 0.1

    state = {"model.embed_tokens.weight": weight(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm(hidden)
        for proj, out_size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            state[p + f"self_attn.{proj}.weight"] = weight(out_size, hidden)
            if qkv_bias:
                state[p + f"self_attn.{proj}.bias"] = weight(out_size)
        state[p + "self_attn.o_proj.weight"] = weight(hidden, q_size)
        if qkv_bias and arch != "qwen2":
            state[p + "self_attn.o_proj.bias"] = weight(hidden)
        if arch == "qwen3":
            state[p + "self_attn.q_norm.weight"] = norm(head_dim)
            state[p + "self_attn.k_norm.weight"] = norm(head_dim)
        state[p + "post_attention_layernorm.weight"] = norm(hidden)
        state[p + "mlp.gate_proj.weight"] = weight(inter, hidden)
        state[p + "mlp.up_proj.weight"] = weight(inter, hidden)
        state[p + "mlp.down_proj.weight"] = weight(hidden, inter)
    state["model.norm.weight"] = norm(hidden)
    if not config.get("tie_word_embeddings", False):
        state["lm_head.weight"] = weight(vocab, hidden)
    return state


def write_tiny_hf_folder(
    path: str | Path,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config_dict: Mapping[str, Any],
    shards: int = 2,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """A Hugging Face model folder: config.json, generation_config.json and safetensors
    (`shards` files plus model.safetensors.index.json, or a single model.safetensors)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(hf_config_dict), indent=2))
    if generation_config is None:
        generation_config = {
            k: hf_config_dict[k] for k in ("bos_token_id", "eos_token_id") if k in hf_config_dict
        }
    (folder / "generation_config.json").write_text(json.dumps(dict(generation_config), indent=2))
    names = list(hf_state_dict)
    if shards <= 1:
        save_file({n: hf_state_dict[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map: dict[str, str] = {}
    for i, group in enumerate(np.array_split(np.arange(len(names)), shards)):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {names[j]: hf_state_dict[names[j]].contiguous() for j in group}
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
    total_size = sum(t.numel() * t.element_size() for t in hf_state_dict.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def gguf_tensor_name(hf_name: str) -> str:
    """HF parameter name -> GGUF tensor name, as llama.cpp's converter writes it."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)  # "model", "layers", N, "self_attn.q_proj"
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"


def permute_qk_for_gguf(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute: per head, rows (first half, second
    half) are interleaved so RoPE's rotated pairs are adjacent rows."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(num_heads, 2, rows // num_heads // 2, *tensor.shape[1:])
        .swapaxes(1, 2)
        .reshape(tensor.shape)
    )


def write_tiny_gguf(
    path: str | Path,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config_dict: Mapping[str, Any],
    tokenizer: Mapping[str, Any] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write HF-named weights as a GGUF file the way llama.cpp's converter would.

    `tokenizer` and `extra_metadata` are extra key/value pairs (e.g. "tokenizer.ggml.tokens": [...]);
    Python types pick the GGUF type: str, bool, int (UINT32, or INT64 if out of range), float
    (FLOAT32), list (array of its first item's type). `weight_type` quantizes the 2-D weights
    (gguf.quants.quantize; row length must be a multiple of the block size); 1-D stays F32.
    `extra_tensors` are written as F32 under their GGUF names, first (e.g. "rope_freqs.weight").
    """
    arch, cfg = hf_config_dict["model_type"], hf_config_dict
    num_heads = cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads", num_heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    writer = GGUFWriter(str(path), arch)
    # 1. model metadata, as the converter's set_gguf_parameters writes it
    writer.add_string("general.name", Path(path).stem)
    metadata: dict[str, Any] = {
        f"{arch}.vocab_size": cfg["vocab_size"],
        f"{arch}.context_length": cfg["max_position_embeddings"],
        f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.block_count": cfg["num_hidden_layers"],
        f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": num_heads,
        f"{arch}.attention.head_count_kv": num_kv_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(cfg.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
    }
    metadata.update(tokenizer or {})
    metadata.update(extra_metadata or {})
    for key, value in metadata.items():
        _add_value(writer, key, value)
    # 2. tensors: rename, permute llama's Q/K, quantize 2-D weights if asked
    for gguf_name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, tensor.detach().to(torch.float32).contiguous().numpy())
    for hf_name, tensor in hf_state_dict.items():
        data = tensor.detach().to(torch.float32)
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            data = permute_qk_for_gguf(data, num_heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            data = permute_qk_for_gguf(data, num_kv_heads)
        array = data.contiguous().numpy()
        if array.ndim == 2 and weight_type != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(hf_name), quantize(array, weight_type), raw_dtype=weight_type)
        else:
            writer.add_tensor(gguf_tensor_name(hf_name), array)
    # 3. file
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def llama3_rope_freqs(hf_config_dict: Mapping[str, Any]) -> torch.Tensor:
    """The `rope_freqs.weight` tensor llama.cpp's converter writes for a llama3-scaled config (and no
    rope.scaling.* keys): per frequency, 1 (high), factor (low), or 1 / ((1 - smooth) / factor + smooth)
    between, which llama.cpp divides the frequency by. Written from the converter's description, in
    float64 per frequency as it loops, independently of transformers' and onecall's formulas."""
    import math

    cfg = hf_config_dict
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < 2**32:
            writer.add_uint32(key, value)
        else:
            writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY)
    else:
        raise TypeError(f"cannot write {key}={value!r} as GGUF metadata")


def hf_and_ours(hf_config: Any, model_cls: Any, *, weight_scale: float, seed: int = 0) -> tuple[Any, Any]:
    """A transformers model with every parameter random (norms ~1 + 0.2 N, biases 0.2 N, the rest
    weight_scale * N: transformers initialises norms to 1 and biases to 0, which would hide them),
    and our DecoderLM loaded from its state dict."""
    from onecall.formats.hf_config import model_config_from_hf
    from onecall.loading.weights import load_weights
    from onecall.model.decoder import DecoderLM

    torch.manual_seed(seed)
    hf = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(weight_scale * torch.randn_like(p))
    ours = DecoderLM(model_config_from_hf(hf_config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return hf, ours


# ---------------------------------------------------------------- the newer families, as converted
# llama.cpp's GGUF architecture for each config.json model_type (Mixtral is written as llama).
_GGUF_ARCH = {
    "llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
    "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
}  # fmt: skip


def write_converted_gguf(
    path: str | Path,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config_dict: Mapping[str, Any],
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    per_expert_tensors: bool = False,
    extra_metadata: Mapping[str, Any] | None = None,
    fuse_gate_up_exps: bool = False,
    type_overrides: Mapping[str, GGMLQuantizationType] | None = None,
) -> Path:
    """A transformers model's state dict and config (to_dict()) as llama.cpp's convert_hf_to_gguf.py
    lays them out, for every family onecall loads (write_tiny_gguf covers the Llama/Qwen basics):

    - names from gguf-py's TensorNameMap for the GGUF architecture (the converter's own table), so
      Phi-3's fused qkv / gate_up become attn_qkv / ffn_up and Gemma's norms post_attention_norm,
      ffn_norm (before the MLP) and post_ffw_norm;
    - MoE experts stacked (num_experts, rows, cols) as ffn_gate_exps / ffn_up_exps / ffn_down_exps
      (transformers 5's [gate; up] split per expert, as the converter stacks per-expert tensors), the
      router ffn_gate_inp kept F32 (the converter forces it), expert_count / expert_used_count and
      Qwen3-MoE's expert_feed_forward_length;
    - Mixtral (arch llama): Q/K rows permuted (LlamaModel.permute);
    - Gemma: 1 added to every norm weight, no lm_head, the caps and sliding_window keys, no rope keys
      for Gemma 2, Gemma 3's global theta, linear factor and sliding theta (rope.freq_base_swa);
    - Phi-3: rope.dimension_count = int(partial * hidden) // heads, original_context_length, sliding
      window (0 for none), and for longrope the factor tensors and the derived attn_factor.
    `weight_type` quantizes every weight of two or more dimensions except the router; 1-D stays F32.
    `per_expert_tensors`: Mixtral as converters wrote it before stacked experts (blk.N.ffn_gate.E.weight).
    `extra_metadata`: more key/value pairs under their full names (a tokenizer's `tokenizer.ggml.*`).
    `fuse_gate_up_exps`: the converter's --fuse-gate-up-exps, each expert's [gate; up] rows in one
    blk.N.ffn_gate_up_exps (llama.cpp views gate as its first half).
    `type_overrides`: GGUF tensor stem (e.g. "ffn_up_exps") -> its type instead of `weight_type`, as
    llama-quantize's mixes (Q4_K_M) store some tensors in another type.
    Written from the converter's description, independently of onecall's reader.
    """
    import math

    from gguf import MODEL_ARCH, get_tensor_name_map

    cfg = hf_config_dict
    arch = _GGUF_ARCH[cfg["model_type"]]
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = dict(cfg.get("rope_parameters") or {})
    global_rope, local_rope = rope.get("full_attention", rope), rope.get("sliding_attention")
    gemma, moe = arch in ("gemma2", "gemma3"), cfg["model_type"] in ("mixtral", "qwen3_moe")
    # 1. metadata, as each model class's set_gguf_parameters writes it
    meta: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": hidden, "block_count": n,
        "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
        "attention.head_count_kv": kv_heads, "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
    }  # fmt: skip
    if arch != "gemma2":  # Gemma2Model writes no RoPE keys (llama.cpp: base 10000)
        meta["rope.freq_base"] = float(global_rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch != "phi3":
        meta["attention.key_length"] = meta["attention.value_length"] = head_dim
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        meta["rope.dimension_count"] = head_dim
    if moe:
        meta["expert_count"] = cfg.get("num_local_experts") or cfg["num_experts"]
        meta["expert_used_count"] = cfg["num_experts_per_tok"]
    if arch == "qwen3moe":
        meta["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    extra_tensors: dict[str, torch.Tensor] = {}
    if arch == "phi3":
        partial = cfg.get("partial_rotary_factor") or global_rope.get("partial_rotary_factor") or 1.0
        original = (
            global_rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        )
        meta["rope.dimension_count"] = int(partial * hidden) // heads
        meta["rope.scaling.original_context_length"] = original
        meta["attention.sliding_window"] = cfg.get("sliding_window") or 0
        if global_rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            meta["rope.scaling.attn_factor"] = (
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )
            extra_tensors["rope_factors_long.weight"] = torch.tensor(global_rope["long_factor"])
            extra_tensors["rope_factors_short.weight"] = torch.tensor(global_rope["short_factor"])
    if gemma:
        meta["attention.sliding_window"] = cfg["sliding_window"]
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap):  # Gemma 3 writes its final cap only when set, never an attention cap
                meta[cap] = float(cfg[cap])
    if arch == "gemma3":
        if global_rope.get("rope_type") == "linear":
            meta["rope.scaling.type"], meta["rope.scaling.factor"] = "linear", float(global_rope["factor"])
        if local_rope is not None:
            meta["rope.freq_base_swa"] = float(local_rope["rope_theta"])
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.name", Path(path).stem)
    for key, value in meta.items():
        _add_value(writer, f"{arch}.{key}", value)
    for key, value in (extra_metadata or {}).items():
        _add_value(writer, key, value)
    # 2. tensors, renamed by the converter's table
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], n)

    def gguf_name(hf_name: str) -> str:
        found = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert found is not None, hf_name
        return str(found)

    tensors: dict[str, torch.Tensor] = dict(extra_tensors)
    for name, tensor in hf_state_dict.items():
        data = tensor.detach().to(torch.float32)
        if gemma and name == "lm_head.weight":
            continue  # Gemma{2,3}Model skip it: tied
        if gemma and name.endswith("norm.weight"):
            data = data + 1  # the converter stores Gemma's 1 + w
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = permute_qk_for_gguf(data, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = permute_qk_for_gguf(data, kv_heads)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        merged = (
            f"model.layers.{layer}.mlp.experts"
            if arch == "qwen3moe"
            else f"layers.{layer}.feed_forward.experts"
        )
        gate, up, down = ("gate_proj", "up_proj", "down_proj") if arch == "qwen3moe" else ("w1", "w3", "w2")
        if per_expert_tensors and ".mlp.experts." in name:
            parts = data.chunk(2, dim=1) if name.endswith("gate_up_proj") else (data,)
            stems = ("ffn_gate", "ffn_up") if name.endswith("gate_up_proj") else ("ffn_down",)
            for stem, stacked in zip(stems, parts, strict=True):
                for e, expert in enumerate(stacked):
                    tensors[f"blk.{layer}.{stem}.{e}.weight"] = expert
        elif fuse_gate_up_exps and name.endswith(".mlp.experts.gate_up_proj"):
            tensors[f"blk.{layer}.ffn_gate_up_exps.weight"] = data
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): each expert's [gate; up] rows
            g, u = data.chunk(2, dim=1)
            tensors[gguf_name(f"{merged}.{gate}.weight")] = g
            tensors[gguf_name(f"{merged}.{up}.weight")] = u
        elif name.endswith(".mlp.experts.down_proj"):
            tensors[gguf_name(f"{merged}.{down}.weight")] = data
        else:
            tensors[gguf_name(name)] = data
    for name, data in tensors.items():
        array = data.contiguous().numpy()
        stem = name.split(".")[2] if name.startswith("blk.") else ""
        qtype = (type_overrides or {}).get(stem, weight_type)
        if array.ndim >= 2 and qtype != GGMLQuantizationType.F32 and ".ffn_gate_inp." not in name:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def fast_copy(model: DecoderLM, int8_activations: bool = False) -> DecoderLM:
    """`model` rebuilt for the CPU fast path (DecoderLM(kernels="fast"): its layers on the native ops;
    not packed on load) with its weights and buffers copied. loading/packing.py's enable_fast_kernels
    then packs its projections; what the engine's loader does as the file streams in."""
    from onecall.model.decoder import DecoderLM

    fast = DecoderLM(model.config, kernels="fast", pack_on_load=False, int8_activations=int8_activations)
    fast.load_state_dict(model.state_dict())
    return fast.eval()


# ---------------------------------------------------------------- the hybrids (Qwen3.5, Qwen3-Next)
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_hybrid_hf(family: str = "qwen3_5", seed: int = 0, **overrides: Any) -> Any:
    """A tiny random-weight transformers causal LM of a hybrid family (HYBRID_FAMILIES), eager attention:
    5 layers (linear, linear, full, linear, full: the second full-attention layer is the KV cache's layer
    1, the third linear one the state cache's layer 2), 4 attention heads of 16 (2 KV heads), DeltaNet
    with 2 key heads of 8 serving 4 value heads of 12, conv kernel 4, vocabulary 160. Qwen3.5 ties its
    embeddings; Qwen3.5-MoE and Qwen3-Next have 4 experts (top 2) and a shared expert of 48, Qwen3-Next
    a dense layer 1 (mlp_only_layers), top k not renormalised and half of each head rotated.

    Weights: norms 1 + 0.2 N (transformers' zero-centred ones then scale by about 2), A_log uniform in
    [-2, 0] (A in [0.14, 1]: decays that never wipe a state out), every other parameter 0.15 N.
    `overrides` go to the config class (e.g. tie_word_embeddings)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    config: dict[str, Any] = dict(
        vocab_size=160, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    config_cls, model_cls = {
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    }[family]
    if family == "qwen3_5":
        config.update(intermediate_size=96, tie_word_embeddings=True)
    elif family == "qwen3_5_moe":
        config.update(moe, tie_word_embeddings=False)
    else:
        rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
        config.update(
            moe, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False, rope_parameters=rope
        )
    config.update(overrides)
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**config, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 0.0)
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return hf


# ---------------------------------------------------------------- a hybrid as a user's folder
def write_tiny_hybrid_chat_folder(path: str | Path, seed: int = 0, num_reply_words: int = 256) -> Path:
    """tiny_hybrid_hf("qwen3_5") as a user's Hugging Face folder, one that `onecall lab --model PATH`
    (or LLM(model=PATH)) loads and chats with: save_pretrained's config.json, generation_config.json
    and safetensors; the embedded SmolLM2's tokenizer as tokenizer.json (onecall.text.byte_level
    rebuilds it from the GGUF's vocabulary, merges and pre-tokenizer name, and `tokenizers` writes it
    out); a tokenizer_config.json with its BOS and EOS, no BOS added, and SmolLM2's own chat template
    (ChatML with a default system prompt). The vocabulary is SmolLM2's (49,152), the context 2,048
    tokens (the lab's 10-turn chat passes 500).

    The output head is untied and zero but for `num_reply_words` whole-word tokens (" the", " book":
    "Ġ" and three or more lowercase letters, each the one token its text encodes to), random as the
    rest: greedy replies are words that the tokenizer gives back from their text. A fully random head
    writes byte-level fragments that re-tokenize differently once a client re-sends the reply as text,
    so no turn would continue the cached path. EOS is never the argmax: every reply runs to max_tokens."""
    import re

    from onecall.formats.checkpoint import resolve_model
    from onecall.formats.gguf import open_gguf
    from onecall.text.byte_level import byte_level_from_gguf

    meta = open_gguf(resolve_model(None).path).metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    tokenizer = byte_level_from_gguf(
        tokens, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.pre"]
    )

    def one_token(i: int, word: str) -> bool:
        return tokenizer.encode(" " + word, add_special_tokens=False).ids == [i]

    words = [i for i, t in enumerate(tokens) if re.fullmatch("Ġ[a-z]{3,}", t) and one_token(i, t[1:])]
    words = words[:num_reply_words]
    assert len(words) == num_reply_words
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    hf = tiny_hybrid_hf(
        "qwen3_5", seed=seed, vocab_size=len(tokens), max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    with torch.no_grad():
        head = torch.zeros_like(hf.lm_head.weight)
        gen = torch.Generator().manual_seed(seed)
        head[words] = 0.15 * torch.randn(len(words), head.shape[1], generator=gen)
        hf.lm_head.weight.copy_(head)
    folder = Path(path)
    hf.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": tokens[bos], "eos_token": tokens[eos], "pad_token": tokens[eos], "add_bos_token": False,
        "chat_template": meta["tokenizer.chat_template"],
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


# ---------------------------------------------------------------- a hybrid, as llama.cpp converts it
# llama.cpp's GGUF architecture for each hybrid config.json model_type
_HYBRID_GGUF_ARCH = {
    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
}  # fmt: skip
# GGUF tensor stems the converter always writes F32 (ModelBase.prepare_tensors' list), beside 1-D tensors
# and norms
_F32_STEMS = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")
# the same tensors by their checkpoint names
_F32_NAMES = ("norm.weight", ".mlp.gate.weight", ".shared_expert_gate.weight", "conv1d.weight")
# llama-quantize's type for a row that is not whole blocks of the one asked for (its fallbacks)
_FALLBACK = {
    GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0: GGMLQuantizationType.F16,
}


def hybrid_weight_type(
    keep_f32: bool, shape: tuple[int, ...], weight_type: GGMLQuantizationType
) -> GGMLQuantizationType:
    """The type write_converted_hybrid_gguf stores a tensor of `shape` in: F32 for 1-D tensors and those
    the converter keeps F32 (`keep_f32`), else `weight_type`, or its fallback (_FALLBACK) where a row
    is not whole blocks of it (the converter falls back to F16 on a quantizer error, llama-quantize from
    Q4_K to Q5_0)."""
    if keep_f32 or len(shape) < 2 or weight_type == GGMLQuantizationType.F32:
        return GGMLQuantizationType.F32
    from gguf import GGML_QUANT_SIZES

    qtype = weight_type
    while shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK[qtype]
    return qtype


def quantize_weight(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's quantizer, and for Q4_K (which it lacks) quantize_q4_k."""
    return quantize_q4_k(array) if qtype == GGMLQuantizationType.Q4_K else quantize(array, qtype)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(..., cols) float32, cols a multiple of 256 -> ggml's Q4_K blocks (..., cols // 256 * 144) uint8:
    per super-block of 256 a float16 d and dmin, per sub-block of 32 a 6-bit scale sc and min m (packed
    as ggml's get_scale_min_k4 reads them), 4-bit q, the value d * sc * q - dmin * m. A plain rounding
    quantizer (llama.cpp searches for better scales; the format is what matters here)."""
    lead = x.shape[:-1]
    sub = x.reshape(-1, 8, 32).astype(np.float32)  # (super-blocks, sub-blocks, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale, offset = (sub.max(-1) - low) / 15, -low  # per sub-block: x ~ scale * q - offset
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)

    def steps(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
        unit32 = unit.astype(np.float32)[:, None]
        safe = np.where(unit32 > 0, unit32, 1)
        return np.where(unit32 > 0, np.clip(np.rint(values / safe), 0, 63), 0).astype(np.uint8)

    sc, m = steps(scale, d), steps(offset, dmin)
    eff_scale = d.astype(np.float32)[:, None] * sc
    eff_offset = dmin.astype(np.float32)[:, None] * m
    safe = np.where(eff_scale > 0, eff_scale, 1)[..., None]
    q = np.where(eff_scale[..., None] > 0, np.clip(np.rint((sub + eff_offset[..., None]) / safe), 0, 15), 0)
    q = q.astype(np.uint8)  # (super-blocks, 8, 32)
    scales = np.empty((len(sub), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    # each 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high ones
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(sub), 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(*lead, -1)


def _period(layer_types: list[str]) -> int:
    """The full_attention_interval a layer pattern has (every interval-th layer full attention)."""
    for interval in range(1, len(layer_types) + 1):
        if all((t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(layer_types)):
            return interval
    raise ValueError(f"layer_types {layer_types} have no full_attention_interval: llama.cpp cannot say them")


def _tiled(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from grouped by key head (g0v0 .. g0v{r-1}, g1v0, ...) to tiled (g0v0, g1v0,
    ..., g0v1, ...): llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], key_heads, per_key, head_dim, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def write_converted_hybrid_gguf(
    path: str | Path,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config_dict: Mapping[str, Any],
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    split_qkvz: bool = True,
    mtp_layers: int = 0,
    metadata_overrides: Mapping[str, Any] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next transformers model (tiny_hybrid_hf's state dict and
    config.to_dict()) as llama.cpp's convert_hf_to_gguf.py writes it (Qwen3NextModel, and for Qwen3.5
    its _LinearAttentionVReorderBase subclasses), from the converter's source:

    - names by gguf-py's TensorNameMap for the arch (post_attention_layernorm -> post_attention_norm,
      in_proj_qkv / _z -> attn_qkv / attn_gate, in_proj_b / _a -> ssm_beta / ssm_alpha, in_proj_ba ->
      ssm_ba, the shared expert -> *_shexp and ffn_gate_inp_shexp, A_log -> ssm_a with no suffix);
    - A_log stored as -exp(A_log); dt_bias renamed dt_proj.bias (ssm_dt.bias); conv1d squeezed to
      (channels, kernel); every norm but linear_attn.norm stored + 1;
    - Qwen3-Next's in_proj_qkvz, rows [q_g; k_g; v_g; z_g] per key head, split into attn_qkv [q; k; v]
      and attn_gate [z] (`split_qkvz` False: kept whole as ssm_in, as converters before the split did);
    - Qwen3.5's value heads (where key heads < value heads) from grouped to tiled: in_proj_qkv's v rows,
      in_proj_z, in_proj_b / _a, A_log, dt_bias, conv1d's v channels, out_proj's columns;
    - experts stacked (num_experts, rows, cols) as ffn_{gate,up,down}_exps, the router, the shared
      expert's gate and the conv F32 (the converter forces them), 1-D tensors and norms F32;
    - metadata: TextModel's keys, expert_feed_forward_length, expert_shared_feed_forward_length, ssm.*
      (conv_kernel, state_size = key head size, group_count = key heads, time_step_rank = value heads,
      inner_size), full_attention_interval (the period of layer_types, which must have one),
      rope.dimension_count = head_dim * partial_rotary_factor, Qwen3.5's rope.dimension_sections.
    `mtp_layers`: that many multi-token-prediction blocks after the decoder's (nextn_predict_layers, as
    newer converters keep the checkpoint's mtp.*): a copy of the first full-attention layer plus the
    nextn.* tensors, random. `weight_type`: every other weight of 2+ dimensions (hybrid_weight_type).
    `metadata_overrides`: `{arch}.*` keys (named without the prefix) to replace, None to leave one out.
    Written from the converter's description, independently of onecall's reader.
    """
    from gguf import MODEL_ARCH, get_tensor_name_map

    cfg = hf_config_dict
    arch = _HYBRID_GGUF_ARCH[cfg["model_type"]]
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = dict(cfg.get("rope_parameters") or {})
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, per_key = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], value_heads // key_heads
    tiled = arch != "qwen3next" and key_heads != value_heads
    # 1. metadata, as TextModel, Qwen2MoeModel and Qwen3NextModel's set_gguf_parameters write it
    meta: dict[str, Any] = {
        "block_count": n + mtp_layers, "context_length": cfg["max_position_embeddings"],
        "embedding_length": hidden, "feed_forward_length": cfg.get("intermediate_size"),
        "attention.head_count": heads, "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.freq_base": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": cfg.get("num_experts"), "expert_used_count": cfg.get("num_experts_per_tok"),
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "expert_feed_forward_length": cfg.get("moe_intermediate_size"),
        "expert_shared_feed_forward_length": cfg.get("shared_expert_intermediate_size"),
        "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": dk, "ssm.group_count": key_heads,
        "ssm.time_step_rank": value_heads, "ssm.inner_size": dv * value_heads,
        "full_attention_interval": _period(cfg["layer_types"]),
        "rope.dimension_count": int(head_dim * partial),
        "rope.dimension_sections": [11, 11, 10, 0] if arch != "qwen3next" else None,  # _Qwen35MRopeMixin's
        "nextn_predict_layers": mtp_layers or None,
    }  # fmt: skip
    for key, value in (metadata_overrides or {}).items():
        meta[key] = value
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.name", Path(path).stem)
    for key, value in meta.items():
        if value is not None:
            _add_value(writer, f"{arch}.{key}", value)
    for key, value in (extra_metadata or {}).items():
        _add_value(writer, key, value)
    # 2. tensors: the MTP blocks first copied in under their block numbers (as _Qwen35MtpMixin renames
    # mtp.layers.0.* to the block after the decoder's)
    state = {k: v.detach().to(torch.float32) for k, v in hf_state_dict.items()}
    prefix = f"model.layers.{cfg['layer_types'].index('full_attention')}."
    copied = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    for j in range(mtp_layers):
        state |= {f"model.layers.{n + j}.{k}": v for k, v in copied.items()}
    name_map = get_tensor_name_map(MODEL_ARCH[arch.upper()], n + mtp_layers)
    tensors: dict[str, torch.Tensor] = {}
    for name, data in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # a tied checkpoint's files hold no lm_head
        if tiled and ".linear_attn." in name:
            data = _tiled_value_heads(name, data, key_heads, per_key, dk, dv)
        if name.endswith(".A_log"):
            data = -torch.exp(data)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        # Qwen3-Next's in_proj_qkvz: per key head [q; k; v; z] -> [q; k; v] and [z] over all heads
        if name.endswith(".in_proj_qkvz.weight") and split_qkvz:
            parts = data.reshape(key_heads, -1, hidden).split([dk, dk, per_key * dv, per_key * dv], dim=1)
            tensors[f"blk.{layer}.attn_qkv.weight"] = torch.cat([p.reshape(-1, hidden) for p in parts[:3]])
            tensors[f"blk.{layer}.attn_gate.weight"] = parts[3].reshape(-1, hidden)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): each expert's [gate; up] rows
            gate, up = data.chunk(2, dim=1)
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
        elif name.endswith(".mlp.experts.down_proj"):
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = data
        else:
            found = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            assert found is not None, name
            tensors[str(found)] = data
    gen = torch.Generator().manual_seed(7)
    for j in range(mtp_layers):  # the nextn tensors of each MTP block (random: never run here)
        for stem, shape in (("eh_proj", (hidden, 2 * hidden)), ("enorm", (hidden,)), ("hnorm", (hidden,)),
                            ("shared_head_norm", (hidden,))):  # fmt: skip
            tensors[f"blk.{n + j}.nextn.{stem}.weight"] = torch.randn(shape, generator=gen)
    for name, data in tensors.items():
        array = data.contiguous().numpy()
        stem = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        keep_f32 = stem in _F32_STEMS or name.endswith("_norm.weight")
        qtype = hybrid_weight_type(keep_f32, array.shape, weight_type)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize_weight(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _tiled_value_heads(
    name: str, data: torch.Tensor, key_heads: int, per_key: int, dk: int, dv: int
) -> torch.Tensor:
    """One linear_attn tensor with its value heads tiled, as _LinearAttentionVReorderBase.modify_tensors."""
    if ".in_proj_qkv." in name or ".conv1d." in name:  # only the v rows / channels, after q and k
        qk = 2 * key_heads * dk
        return torch.cat([data[:qk], _tiled(data[qk:], 0, key_heads, per_key, dv)])
    if ".in_proj_z." in name:
        return _tiled(data, 0, key_heads, per_key, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled(data, 0, key_heads, per_key, 1)
    if ".out_proj." in name:
        return _tiled(data, 1, key_heads, per_key, dv)
    return data


def hybrid_file_weights(
    hf_state_dict: Mapping[str, torch.Tensor], weight_type: GGMLQuantizationType
) -> dict[str, torch.Tensor]:
    """The weights write_converted_hybrid_gguf(weight_type) stores, in the checkpoint's names and layout:
    each tensor it quantizes round-tripped through that quantization (gguf's dequantizer). Quantization
    runs along rows, so the converter's row moves (splits, stacking, value heads) commute with it, and so
    does out_proj's column move where the value heads are whole blocks (a multiple of 32 columns: the
    tests' quantized models), each block quantized on its own (Q4_K's super-block scales too: the same
    32-column blocks, moved whole, give the same maxima)."""
    from gguf.quants import dequantize

    out = {}
    for name, tensor in hf_state_dict.items():
        data = tensor.detach().float()
        keep_f32 = name.endswith(_F32_NAMES)
        qtype = hybrid_weight_type(keep_f32, tuple(data.shape), weight_type)
        if qtype != GGMLQuantizationType.F32:
            stored = quantize_weight(data.numpy(), qtype)
            data = torch.from_numpy(dequantize(stored, qtype).astype(np.float32)).reshape(data.shape)
        out[name] = data
    return out


# ---------------------------------------------------------------- DeepSeek-V3 (llama.cpp's deepseek2)
# the checkpoint tensors the converter keeps F32 whatever the output type: 1-D tensors, and the router
_DEEPSEEK_F32 = (".mlp.gate.weight",)


def write_converted_deepseek_gguf(
    path: str | Path,
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config_dict: Mapping[str, Any],
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    *,
    split_kv_b: bool = True,
    extra_metadata: Mapping[str, Any] | None = None,
    metadata_overrides: Mapping[str, Any] | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """A DeepseekV3ForCausalLM state dict and config (to_dict()) as llama.cpp's converter writes them
    (DeepseekV2Model on TextModel, arch deepseek2), from the converter's description:

    - metadata: TextModel's (context, embedding and feed-forward lengths, head counts with
      head_count_kv 1 (the heads in the older layout), rope.freq_base, rms epsilon, expert_count / _used_count, expert_group_count /
      _used_count from n_group / topk_group, expert_gating_func 2 for sigmoid, yarn's type, factor,
      original context and betas), then DeepseekV2Model's: leading_dense_block_count, vocab_size,
      q_lora_rank (only when set), kv_lora_rank, key_length kv_lora_rank + rope and value_length
      kv_lora_rank, key_length_mla / value_length_mla the per-head sizes, expert_feed_forward_length,
      expert_shared_count, expert_weights_scale, expert_weights_norm (only when true),
      rope.dimension_count and, under yarn, yarn_log_multiplier = 0.1 * mscale_all_dim;
    - tensors: gguf-py's DEEPSEEK2 name table; e_score_correction_bias as exp_probs_b.bias; the
      experts stacked (E, rows, cols) as ffn_{gate,up,down}_exps (transformers' (E, 2I, H) [gate; up]
      split); kv_b_proj split per head into attn_k_b (H, rank, nope: transposed) and attn_v_b (H, v,
      rank); no lm_head when tied; nothing permuted (llama.cpp's deepseek2 RoPE rotates adjacent pairs,
      as rope_interleave does).
    `split_kv_b` False: the layout of converters before the split (attn_kv_b whole; key_length /
    value_length the per-head sizes, no *_mla keys). `weight_type` for tensors of 2+ dims but the router
    (the converter's F16 where a row is not whole blocks). `metadata_overrides`: key (without the arch) ->
    value, None to leave a key out. `omit`: GGUF tensor names left out.
    """
    from gguf import MODEL_ARCH, get_tensor_name_map

    cfg, arch = hf_config_dict, "deepseek2"
    n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nope, rope_dim, v_dim, rank = (cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                    "kv_lora_rank"))  # fmt: skip
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    # 1. metadata
    meta: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": n, "feed_forward_length": cfg["intermediate_size"], "attention.head_count": heads,
        "attention.head_count_kv": 1, "rope.freq_base": float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": cfg["n_routed_experts"], "expert_used_count": cfg["num_experts_per_tok"],
        "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
        "expert_gating_func": 2, "leading_dense_block_count": cfg["first_k_dense_replace"],
        "vocab_size": cfg["vocab_size"], "attention.kv_lora_rank": rank,
        "expert_feed_forward_length": cfg["moe_intermediate_size"], "expert_shared_count": cfg["n_shared_experts"],
        "expert_weights_scale": float(cfg["routed_scaling_factor"]), "rope.dimension_count": rope_dim,
    }  # fmt: skip
    if cfg.get("q_lora_rank") is not None:
        meta["attention.q_lora_rank"] = cfg["q_lora_rank"]
    if cfg.get("norm_topk_prob"):
        meta["expert_weights_norm"] = True
    if split_kv_b:
        meta |= {"attention.key_length": rank + rope_dim, "attention.value_length": rank,
                 "attention.key_length_mla": nope + rope_dim, "attention.value_length_mla": v_dim}  # fmt: skip
    else:  # the MHA view (head_count_kv the heads): "converts into MQA" came with the split
        meta |= {"attention.key_length": nope + rope_dim, "attention.value_length": v_dim,
                 "attention.head_count_kv": heads}  # fmt: skip
    if rope.get("rope_type") == "yarn":
        meta |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                 "rope.scaling.original_context_length": rope["original_max_position_embeddings"]}  # fmt: skip
        for ours in ("beta_fast", "beta_slow"):
            if rope.get(ours) is not None:
                meta[f"rope.scaling.yarn_{ours}"] = float(rope[ours])
        if rope.get("mscale_all_dim") is not None:
            meta["rope.scaling.yarn_log_multiplier"] = 0.1 * float(rope["mscale_all_dim"])
    for key, value in (metadata_overrides or {}).items():
        meta.pop(key, None)
        if value is not None:
            meta[key] = value
    writer = GGUFWriter(str(path), arch)
    writer.add_string("general.name", Path(path).stem)
    for key, value in meta.items():
        _add_value(writer, f"{arch}.{key}", value)
    for key, value in (extra_metadata or {}).items():
        _add_value(writer, key, value)
    # 2. tensors
    name_map = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, n)
    tensors: dict[str, tuple[torch.Tensor, bool]] = {}  # GGUF name -> (data, kept F32)

    def put(hf_name: str, data: torch.Tensor, keep_f32: bool = False) -> None:
        found = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert found is not None, hf_name
        tensors[str(found)] = (data, keep_f32)

    for name, tensor in hf_state_dict.items():
        data = tensor.detach().to(torch.float32)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if name.endswith("e_score_correction_bias"):
            put(name.replace("e_score_correction_bias", "e_score_correction.bias"), data)
        elif name.endswith(".mlp.experts.gate_up_proj"):  # (E, 2I, H): each expert's [gate; up] rows
            gate, up = data.chunk(2, dim=1)
            put(f"model.layers.{layer}.mlp.experts.gate_proj.weight", gate)
            put(f"model.layers.{layer}.mlp.experts.up_proj.weight", up)
        elif name.endswith(".mlp.experts.down_proj"):
            put(f"model.layers.{layer}.mlp.experts.down_proj.weight", data)
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            k_b, v_b = data.view(heads, nope + v_dim, rank).split((nope, v_dim), dim=1)
            put(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2))
            put(name.replace("kv_b_proj", "v_b_proj"), v_b)
        else:
            put(name, data, name.endswith(_DEEPSEEK_F32))
    for name, (data, keep_f32) in tensors.items():
        if name in omit:
            continue
        array = data.contiguous().numpy()
        qtype = hybrid_weight_type(keep_f32 or array.ndim < 2, array.shape, weight_type)
        if qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# ---- gpt-oss in llama.cpp's converter layout (arch gpt-oss) ----
def _gpt_oss_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params, float(params.get("rope_theta", cfg.get("rope_theta", 150000.0)))


def nibbles_to_ggml(blocks: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 bytes (..., 16), value 2j in byte j's low nibble and 2j + 1 in its high one ->
    ggml's block_mxfp4 qs (value j low, j + 16 high): what GptOssModel.transform_nibble_layout does."""
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # (..., 32) in order
    return values[..., :16] | (values[..., 16:] << 4)


def mxfp4_bytes(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's blocks (E, rows, G, 16) and scales (E, rows, G) -> ggml MXFP4 bytes (E, rows, G * 17)
    (GptOssModel.repack_mxfp4: the scale byte, then the reordered nibbles, per block)."""
    packed = torch.cat((scales.unsqueeze(-1), nibbles_to_ggml(blocks)), dim=-1)
    return packed.reshape(*packed.shape[:2], -1).numpy()


def write_gpt_oss_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    experts: dict[str, np.ndarray] | None = None,
    omit: tuple[str, ...] = (),
    extra: dict[str, Any] | None = None,
    yarn: bool = True,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """A GptOssForCausalLM state dict and config (to_dict()) as llama.cpp's converter lays them out (the
    module docstring lists what it writes). `experts`: GGUF expert weight name -> its MXFP4 bytes, in
    place of the float tensors; `omit`: GGUF tensor names left out; `extra`: more metadata (key -> int);
    `weight_type` F16: the 2-D weights but the router in F16, as convert_hf_to_gguf.py --outtype f16
    writes them (norms, biases (the experts' 2-D ones too), sinks and ffn_gate_inp F32); `extra_metadata`: more keys of any type
    (a tokenizer's)."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    n = cfg["num_hidden_layers"]
    rope, theta = _gpt_oss_rope(cfg)
    from gguf import RopeScalingType

    w = GGUFWriter(str(path), "gpt-oss")
    w.add_string("general.name", path.stem)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(n)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings", 4096)))
    for token in ("bos", "eos"):
        if isinstance(cfg.get(f"{token}_token_id"), int):
            getattr(w, f"add_{token}_token_id")(cfg[f"{token}_token_id"])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for key, value in (extra_metadata or {}).items():
        _add_value(w, key, value)
    tensor_map = get_tensor_name_map(MODEL_ARCH.GPT_OSS, n)
    tensors: dict[str, torch.Tensor | np.ndarray] = {}
    for name, tensor in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("mlp.experts.gate_up_proj"):
            t = tensor.transpose(-1, -2)  # (E, 2I, H), rows interleaved
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = t[:, ::2]
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = t[:, 1::2]
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            tensors[f"blk.{layer}.ffn_gate_exps.bias"] = tensor[..., ::2]
            tensors[f"blk.{layer}.ffn_up_exps.bias"] = tensor[..., 1::2]
        elif name.endswith("mlp.experts.down_proj"):
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = tensor.transpose(-1, -2)
        elif name.endswith("mlp.experts.down_proj_bias"):
            tensors[f"blk.{layer}.ffn_down_exps.bias"] = tensor
        else:
            suffix = ".weight" if name.endswith("sinks") else ""
            gguf_name = tensor_map.get_name(name + suffix, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            tensors[gguf_name] = tensor
    tensors |= experts or {}
    for gguf_name, value in tensors.items():
        if gguf_name in omit:
            continue
        if isinstance(value, np.ndarray):
            w.add_tensor(gguf_name, value, raw_dtype=GGMLQuantizationType.MXFP4)
        elif (
            weight_type == GGMLQuantizationType.F16
            and value.dim() >= 2
            and "ffn_gate_inp" not in gguf_name
            and not gguf_name.endswith(".bias")  # the experts' (E, I) biases stay F32 (llama.cpp's add_id)
        ):
            w.add_tensor(gguf_name, value.detach().half().contiguous().numpy())
        else:
            w.add_tensor(
                gguf_name, value.detach().float().contiguous().numpy(), raw_dtype=GGMLQuantizationType.F32
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Gemma 4 in llama.cpp's converter layout (arch gemma4) ----
def _gemma4_gguf_name(name: str, tensor_map: Any) -> str | None:
    """A checkpoint name -> its GGUF name, as Gemma4Model.filter_tensors / modify_tensors rename it."""
    parts = name.split(".")
    if name.endswith(("router.scale", "router.per_expert_scale")):
        stem = "ffn_gate_inp" if name.endswith("router.scale") else "ffn_down_exps"
        return f"blk.{parts[2]}.{stem}.scale"
    if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
        name += ".weight"
    return tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))


def write_gemma4_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    rope_factor: float = 1.0,
    add_tokenizer: Callable[[GGUFWriter], None] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """A Gemma4ForCausalLM state dict and config (to_dict()) as llama.cpp's converter lays them out
    (the module docstring lists what it writes). `rope_factor`: the value written for rope_freqs'
    rotated pairs (the converter: 1.0); `add_tokenizer` writes the tokenizer.* keys, or `extra_metadata`
    gives more keys of any type (a tokenizer's)."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    from onecall.model.config import GLOBAL, SLIDING

    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    swa = [t == SLIDING for t in types]
    shared = cfg.get("num_kv_shared_layers") or 0
    rope = cfg["rope_parameters"]
    sliding_dim, kv = cfg["head_dim"], cfg["num_key_value_heads"]
    # config.json's global_head_dim / num_global_key_value_heads (transformers 5 keeps them per layer)
    per_layer = cfg.get("per_layer_config") or {}
    first_global = next(
        (per_layer[str(i)] for i, t in enumerate(types) if t == GLOBAL and str(i) in per_layer), {}
    )
    global_dim = cfg.get("global_head_dim") or first_global.get("head_dim", sliding_dim)
    global_kv = cfg.get("num_global_key_value_heads")
    if global_kv is None and first_global.get("num_key_value_heads", kv) != kv:
        global_kv = first_global["num_key_value_heads"]
    w = GGUFWriter(str(path), "gemma4")
    w.add_string("general.name", path.stem)
    if add_tokenizer is not None:  # the tokenizer.* keys
        add_tokenizer(w)
    for key, value in (extra_metadata or {}).items():
        _add_value(w, key, value)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    width = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        w.add_feed_forward_length([width if i < n - shared else 2 * width for i in range(n)])
    else:
        w.add_feed_forward_length(width)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([kv if s else global_kv for s in swa] if global_kv is not None else kv)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_key_length(global_dim)
    w.add_value_length(global_dim)
    w.add_key_length_swa(sliding_dim)
    w.add_value_length_swa(sliding_dim)
    w.add_rope_freq_base(float(rope[GLOBAL]["rope_theta"]))
    w.add_rope_freq_base_swa(float(rope[SLIDING]["rope_theta"]))
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_rope_dimension_count(global_dim)
    w.add_rope_dimension_count_swa(int(sliding_dim * cfg.get("partial_rotary_factor", 1.0)))
    rotated = int(global_dim * rope[GLOBAL]["partial_rotary_factor"] / 2)
    freqs = [rope_factor] * rotated + [1e30] * (global_dim // 2 - rotated)
    tensors = {"rope_freqs.weight": torch.tensor(freqs, dtype=torch.float32)}
    tensor_map = get_tensor_name_map(MODEL_ARCH.GEMMA4, n)
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings", True):
            continue  # tied: a checkpoint on disk holds no lm_head
        gguf_name = _gemma4_gguf_name(name, tensor_map)
        assert gguf_name is not None, name
        tensors[gguf_name] = tensor
    for gguf_name, tensor in tensors.items():
        kind = weight_type if tensor.dim() >= 2 else GGMLQuantizationType.F32
        f16 = kind == GGMLQuantizationType.F16
        array = tensor.detach().float().numpy().astype(np.float16 if f16 else np.float32)
        w.add_tensor(gguf_name, array, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
