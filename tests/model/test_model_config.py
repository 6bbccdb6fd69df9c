"""model_config_from_hf and weights.load_weights: what they accept and what they refuse.

Refusals must be UnsupportedModelError naming the offending value, never a
model that runs silently wrong.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen3Config

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache

ROOT = Path(__file__).resolve().parents[2]

# What SmolLM2-135M-Instruct's config.json says (the fields that matter).
SMOLLM2: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "torch_dtype": "bfloat16",
}
# Qwen2.5-0.5B-Instruct's config.json (abridged).
QWEN25: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 21,
    "tie_word_embeddings": True,
}
# Qwen3-0.6B's config.json (abridged): head_dim 128 != 1024 / 16.
QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": True,
}

# Llama-3.2-1B-Instruct's config.json (abridged).
LLAMA32: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
# Mistral-7B-Instruct-v0.3's config.json (abridged).
MISTRAL: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32768,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
# Phi-4-mini-instruct's config.json (abridged; factor lists shortened to their real length 48).
PHI4_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "long_factor": [1.0 + i for i in range(48)],
        "short_factor": [1.0] * 48,
        "type": "longrope",
    },
    "sliding_window": 262144,
    "tie_word_embeddings": True,
}


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(base)
    for key, value in changes.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def test_smollm2_config() -> None:
    c = model_config_from_hf(SMOLLM2)
    assert (c.architecture, c.hidden_size, c.num_hidden_layers) == ("llama", 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (1536, 49152, 100000.0, 1e-5)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm and not c.o_proj_bias
    assert c.max_position_embeddings == 8192
    assert 134_000_000 < c.num_parameters < 135_000_000  # "135M"
    assert ModelConfig(**c.to_dict()) == c


def test_qwen_configs() -> None:
    q2 = model_config_from_hf(QWEN25)
    assert (q2.architecture, q2.attention_bias, q2.qk_norm, q2.o_proj_bias) == ("qwen2", True, False, False)
    assert (q2.head_dim, q2.num_key_value_heads, q2.rope_theta) == (64, 2, 1e6)
    q3 = model_config_from_hf(QWEN3)
    assert (q3.architecture, q3.attention_bias, q3.qk_norm, q3.head_dim) == ("qwen3", False, True, 128)
    assert q3.max_position_embeddings == 40960


def test_transformers_5_dicts_and_defaults() -> None:
    # transformers 5 writes rope_theta inside rope_parameters and no "architectures".
    kwargs: dict[str, Any] = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5
    )
    d = Qwen3Config(**kwargs).to_dict()
    c = model_config_from_hf(d)
    assert (c.architecture, c.rope_theta, c.head_dim) == ("qwen3", 5e5, 128)
    assert (
        model_config_from_hf(
            Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4).to_dict()
        ).head_dim
        == 16
    )
    # Defaults: head_dim from hidden/heads, kv heads = heads, theta 10000.
    c = model_config_from_hf(with_(SMOLLM2, head_dim=..., num_key_value_heads=..., rope_theta=...))
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (64, 9, 10000.0)
    # model_type alone is enough; rope_scaling {"rope_type": "default"} is plain RoPE.
    c = model_config_from_hf(with_(SMOLLM2, architectures=..., rope_scaling={"rope_type": "default"}))
    assert c.architecture == "llama"


def test_scaled_rope_families() -> None:
    c = model_config_from_hf(LLAMA32)
    assert c.rope_scaling is not None
    assert (
        c.rope_scaling.rope_type,
        c.rope_scaling.factor,
        c.rope_scaling.original_max_position_embeddings,
    ) == (
        "llama3",
        32.0,
        8192,
    )
    assert ModelConfig(**c.to_dict()) == c  # the nested RopeScaling survives a dict round trip
    m = model_config_from_hf(MISTRAL)
    assert (m.architecture, m.head_dim, m.rope_scaling, m.attention_bias) == ("mistral", 128, None, False)
    assert model_config_from_hf(with_(MISTRAL, sliding_window=32768)).sliding_window is None  # covers all
    # a window shorter than the context bites: every layer attends to its last sliding_window positions
    assert model_config_from_hf(with_(MISTRAL, sliding_window=4096)).sliding_window == 4096
    assert model_config_from_hf(with_(MISTRAL, sliding_window=...)).sliding_window == 4096  # the default
    assert (
        model_config_from_hf(with_(PHI4_MINI, sliding_window=2047)).sliding_window == 2047
    )  # Phi-3-mini-4k's
    p = model_config_from_hf(PHI4_MINI)
    assert (p.architecture, p.head_dim, p.rotary_dim, p.partial_rotary_factor) == ("phi3", 128, 96, 0.75)
    assert p.rope_scaling is not None and p.rope_scaling.rope_type == "longrope"
    assert (p.rope_scaling.factor, p.rope_scaling.original_max_position_embeddings) == (32.0, 4096)
    assert p.rope_scaling.long_factor == tuple(1.0 + i for i in range(48))
    # Phi-3's old "su" name; transformers 5's rope_parameters; yarn's factor from the lengths.
    su = with_(PHI4_MINI, rope_scaling=PHI4_MINI["rope_scaling"] | {"type": "su"})
    assert model_config_from_hf(su).rope_scaling == p.rope_scaling
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 32768}
    q = model_config_from_hf(with_(QWEN3, rope_parameters=yarn, max_position_embeddings=131072))
    assert q.rope_scaling is not None and (q.rope_scaling.rope_type, q.rope_scaling.factor) == ("yarn", 4.0)
    d = model_config_from_hf(with_(SMOLLM2, rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert d.rope_scaling is not None and d.rope_scaling.rope_type == "dynamic"


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (with_(MISTRAL, sliding_window=0), "sliding_window"),
        (with_(PHI4_MINI, sliding_window="2047"), "sliding_window"),
        (
            with_(QWEN3, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2"),
            "DeepseekV2ForCausalLM",
        ),
        (  # deepseek_v3 without its latent attention's shapes: refused, not transformers' 671B defaults
            with_(QWEN3, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"),
            "kv_lora_rank",
        ),
        (with_(SMOLLM2, architectures=["GemmaForCausalLM"]), "GemmaForCausalLM"),  # Gemma 1: not ours
        (with_(SMOLLM2, architectures=..., model_type="gemma"), "gemma"),
        (with_(SMOLLM2, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
        (
            with_(LLAMA32, rope_scaling=LLAMA32["rope_scaling"] | {"high_freq_factor": 0.5}),
            "high_freq_factor",
        ),
        (with_(QWEN25, rope_scaling={"type": "yarn", "factor": "4"}), "factor"),
        (with_(QWEN25, rope_scaling={"type": "yarn", "factor": 4.0, "truncate": "no"}), "truncate"),
        (with_(SMOLLM2, rope_scaling={"type": "linear"}), "needs factor"),
        (with_(SMOLLM2, rope_scaling={"type": "linear", "factor": -2.0}), "-2.0"),
        (with_(SMOLLM2, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}), "proportional"),
        (with_(SMOLLM2, rope_scaling={"rope_type": "longrope", "factor": 2.0}), "short_factor"),
        (with_(SMOLLM2, rope_parameters={"full_attention": {"rope_type": "default"}}), "full_attention"),
        (
            with_(PHI4_MINI, rope_scaling=PHI4_MINI["rope_scaling"] | {"long_factor": [1.0] * 64}),
            "long_factor",
        ),
        (with_(PHI4_MINI, rope_scaling={"type": "linear", "factor": 2.0}), "phi3"),
        (with_(PHI4_MINI, partial_rotary_factor=39 / 128, rope_scaling=...), "39 rotary dims"),
        (with_(SMOLLM2, partial_rotary_factor=0.5), "0.5"),
        (with_(SMOLLM2, hidden_act="gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
        (with_(QWEN25, use_sliding_window=True), "use_sliding_window"),
        (with_(QWEN3, layer_types=["sliding_attention", "full_attention"]), "sliding_attention"),
        (with_(SMOLLM2, mlp_bias=True), "mlp_bias"),
        (with_(SMOLLM2, hidden_size=..., vocab_size=...), "vocab_size, hidden_size"),
        (with_(SMOLLM2, num_key_value_heads=4), "num_key_value_heads (4)"),
        (with_(SMOLLM2, num_hidden_layers=0), "num_hidden_layers"),
        (with_(SMOLLM2, vocab_size=-5), "-5"),
        (with_(SMOLLM2, intermediate_size=1536.0), "1536.0"),
        (with_(SMOLLM2, head_dim=..., hidden_size=577), "577"),
        (with_(SMOLLM2, rope_theta="big"), "big"),
    ],
)
def test_refusals_name_the_value(config: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=None) as info:
        model_config_from_hf(config)
    assert needle in str(info.value), str(info.value)


TINY = with_(
    QWEN25,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=40,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def tiny_weights(c: ModelConfig) -> dict[str, torch.Tensor]:
    """A complete Hugging Face-named state dict for `c` (qwen2 layout)."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    w = {
        "model.embed_tokens.weight": torch.randn(c.vocab_size, h),
        "model.norm.weight": torch.randn(h),
        "lm_head.weight": torch.randn(c.vocab_size, h),
    }
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        w |= {
            p + "self_attn.q_proj.weight": torch.randn(q, h),
            p + "self_attn.q_proj.bias": torch.randn(q),
            p + "self_attn.k_proj.weight": torch.randn(kv, h),
            p + "self_attn.k_proj.bias": torch.randn(kv),
            p + "self_attn.v_proj.weight": torch.randn(kv, h),
            p + "self_attn.v_proj.bias": torch.randn(kv),
            p + "self_attn.o_proj.weight": torch.randn(h, q),
            p + "mlp.gate_proj.weight": torch.randn(i, h),
            p + "mlp.up_proj.weight": torch.randn(i, h),
            p + "mlp.down_proj.weight": torch.randn(h, i),
            p + "input_layernorm.weight": torch.randn(h),
            p + "post_attention_layernorm.weight": torch.randn(h),
            p + "self_attn.rotary_emb.inv_freq": torch.randn(d // 2),
        }  # ignored
    return w


def test_load_weights_fuses_and_casts() -> None:
    c = model_config_from_hf(TINY)
    w = tiny_weights(c)
    model = DecoderLM(c, dtype=torch.bfloat16)
    load_weights(model, w.items())
    params = dict(model.named_parameters())
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    qkv_weight = params["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv_weight.dtype == torch.bfloat16
    assert torch.equal(qkv_weight[:q], w["model.layers.1.self_attn.q_proj.weight"].bfloat16())
    assert torch.equal(qkv_weight[q + kv :], w["model.layers.1.self_attn.v_proj.weight"].bfloat16())
    qkv_bias = params["model.layers.1.self_attn.qkv_proj.bias"]
    assert torch.equal(qkv_bias[q : q + kv], w["model.layers.1.self_attn.k_proj.bias"].bfloat16())
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[: c.intermediate_size], w["model.layers.0.mlp.gate_proj.weight"].bfloat16())
    assert torch.equal(gate_up[c.intermediate_size :], w["model.layers.0.mlp.up_proj.weight"].bfloat16())


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
        (lambda w: w.pop("lm_head.weight"), "lm_head.weight"),
        (lambda w: w.pop("model.layers.0.self_attn.k_proj.bias"), "model.layers.0.self_attn.k_proj.bias"),
        (lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": torch.randn(31, 32)}), "(31, 32)"),
        (lambda w: w.update({"model.norm.weight": torch.randn(33)}), "model.norm.weight"),
        (lambda w: w.update({"model.layers.2.mlp.gate_proj.weight": torch.randn(48, 32)}), "model.layers.2"),
        (lambda w: w.update({"model.layers.0.self_attn.q_norm.weight": torch.randn(8)}), "q_norm"),
    ],
)
def test_load_weights_refusals_name_the_tensor(mutate: Any, needle: str) -> None:
    c = model_config_from_hf(TINY)
    w = tiny_weights(c)
    mutate(w)
    with pytest.raises(UnsupportedModelError) as info:
        load_weights(DecoderLM(c), w.items())
    assert needle in str(info.value), str(info.value)


def test_tied_embeddings_accept_or_omit_lm_head() -> None:
    c = model_config_from_hf(with_(TINY, tie_word_embeddings=True))
    w = tiny_weights(c)
    model = DecoderLM(c)
    load_weights(model, w.items())  # lm_head.weight present: ignored, the embedding is used
    hidden = torch.randn(3, c.hidden_size)
    assert torch.allclose(model.compute_logits(hidden), hidden @ w["model.embed_tokens.weight"].T, atol=1e-5)
    w.pop("lm_head.weight")
    load_weights(DecoderLM(c), w.items())


def test_block_manager_bytes_and_copy_slots() -> None:
    assert PagedKVCache.bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    kv = PagedKVCache(2, 4, 4, 2, 8, torch.float32, "cpu")
    assert kv.k.shape == (2, 16, 2, 8) and kv.v.shape == (2, 16, 2, 8)
    kv.k.copy_(torch.randn_like(kv.k))
    kv.v.copy_(torch.randn_like(kv.v))
    before_k, before_v = kv.k.clone(), kv.v.clone()
    kv.copy_slots([9, 10], [0, 1])
    assert torch.equal(kv.k[:, [0, 1]], before_k[:, [9, 10]]) and torch.equal(
        kv.v[:, [0, 1]], before_v[:, [9, 10]]
    )
    assert torch.equal(kv.k[:, 2:], before_k[:, 2:])


@pytest.mark.slow
def test_model_code_imports_only_torch() -> None:
    """onecall.model must not pull in the engine, the server, the text modules or transformers."""
    code = (
        "import sys, onecall.model.decoder, onecall.model.attention\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'fastapi') "
        "or '.'.join(m.split('.')[:2]) in ('onecall.engine', 'onecall.server', 'onecall.text', 'onecall.sampling', "
        "'onecall.llm'))\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
