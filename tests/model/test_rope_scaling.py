"""Scaled and partial RoPE, and the families that bring them, against transformers (float32, CPU).

1. Tables: model/rope.py's inv_freq and attention factor for every rope type against transformers'
   ROPE_INIT_FUNCTIONS on full-size configs (Llama 3.1, Qwen2.5 with yarn, Phi-3.5 longrope, Phi-4-mini
   partial rotary), and cos/sin rows at positions far past the original context against
   transformers' rotary embedding modules. Tolerance: 1e-6 relative on inv_freq, 2e-4 absolute on
   cos/sin at position ~1e5 (float32 angle rounding grows with the position; both sides round alike).
2. Models: tiny random-weight Llama (llama3, linear), Qwen2 (yarn), Phi-3 (longrope + partial rotary,
   fused checkpoint tensors) and Mistral, loaded into DecoderLM; prefill, decode through the paged
   cache and a prefix-cache hit, with sequences longer than original_max_position_embeddings (16)
   so the scaling changes the answer. Tolerance: tests/model/test_model_numerics.py's ATOL (1e-4).
3. A GGUF round trip of a llama3-scaled model (rope_freqs.weight, as llama.cpp's converter writes it)
   and the yarn metadata keys.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from onecall.formats.checkpoint import iter_weights, load_hf_config_dict, resolve_model
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model import rope
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.layers import RotaryEmbedding
from tests.helpers.make_models import hf_and_ours, llama3_rope_freqs, write_tiny_gguf
from tests.model.test_model_numerics import Harness, Seq, assert_close, hf_logits, prompt

ORIGINAL = 16  # original_max_position_embeddings of the tiny models: every test runs past it


# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


def factors(n: int, low: float, high: float, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(n, generator=gen)).tolist()


# ---------------------------------------------------------------- 1. tables


LLAMA31 = LlamaConfig(
    hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
QWEN25_YARN = Qwen2Config(
    hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, rope_theta=1e6,
)  # fmt: skip
YARN_MSCALE = Qwen2Config(
    hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=65536,
    rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
)  # fmt: skip
LINEAR = LlamaConfig(
    hidden_size=2048, num_attention_heads=16, max_position_embeddings=8192,
    rope_scaling={"type": "linear", "factor": 2.0},
)  # fmt: skip
PHI35 = Phi3Config(
    hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
    rope_scaling={"type": "longrope", "short_factor": factors(48, 1.0, 1.1, 0),
                  "long_factor": factors(48, 1.0, 64.0, 1)},
)  # fmt: skip
PHI4_MINI = Phi3Config(
    hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
    original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_theta=10000.0,
    rope_scaling={"type": "longrope", "short_factor": factors(48, 1.0, 3.0, 2),
                  "long_factor": factors(48, 1.0, 60.0, 3)},
)  # fmt: skip
TABLE_CONFIGS = {
    "llama3": LLAMA31, "yarn": QWEN25_YARN, "yarn_mscale": YARN_MSCALE, "linear": LINEAR,
    "longrope": PHI35, "longrope_partial": PHI4_MINI,
}  # fmt: skip


def ours_of(hf_config: Any) -> ModelConfig:
    return model_config_from_hf(hf_config.to_dict())


@pytest.mark.parametrize("name", sorted(TABLE_CONFIGS))
def test_inv_freq_and_attention_factor_match_transformers(name: str) -> None:
    hf_config = TABLE_CONFIGS[name]
    c = ours_of(hf_config)
    assert c.rope_scaling is not None
    rope_type = hf_config.rope_parameters["rope_type"]
    assert c.rope_scaling.rope_type == rope_type
    # seq_len None: the short set (longrope); past the original length: the long set.
    for context_len, seq_len in ((c.max_position_embeddings, c.max_position_embeddings), (2048, None)):
        want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)
        got, got_factor = rope.inv_freq_and_attention_factor(
            c.rope_theta, c.rotary_dim, c.rope_scaling, context_len
        )
        assert got.shape == want.shape == (c.rotary_dim // 2,)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert got_factor == pytest.approx(want_factor, rel=1e-12)


def test_dynamic_is_plain_rope_within_max_position_embeddings() -> None:
    hf_config = LlamaConfig(
        hidden_size=1024, num_attention_heads=8, max_position_embeddings=4096,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    )  # fmt: skip
    c = ours_of(hf_config)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config, "cpu", seq_len=4096)
    got, factor = rope.inv_freq_and_attention_factor(c.rope_theta, c.rotary_dim, c.rope_scaling, 4096)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert factor == 1.0


@pytest.mark.parametrize(("name", "module"), [("llama3", LlamaRotaryEmbedding), ("yarn", LlamaRotaryEmbedding),
                                             ("longrope_partial", Phi3RotaryEmbedding)])  # fmt: skip
def test_cos_sin_far_past_the_original_context(name: str, module: Any) -> None:
    """Rows of our tables against transformers' rotary module at positions up to ~1e5 (longrope: a
    forward whose max position + 1 > original picks the long set, as our full-length table does)."""
    hf_config = TABLE_CONFIGS[name]
    c = dataclasses.replace(ours_of(hf_config), max_position_embeddings=100_001)
    ours = RotaryEmbedding.from_config(c, torch.float32, "cpu")
    positions = torch.tensor([0, 1, 17, 5000, 40_000, 99_999, 100_000])
    cos, sin = ours(positions)
    hf_cos, hf_sin = module(hf_config)(torch.zeros(1, dtype=torch.float32), positions[None])
    half = c.rotary_dim // 2
    torch.testing.assert_close(cos[:, 0, :half], hf_cos[0, :, :half], rtol=0, atol=2e-4)
    torch.testing.assert_close(sin[:, 0, :half], hf_sin[0, :, :half], rtol=0, atol=2e-4)
    if c.rotary_dim < c.head_dim:  # pass-through pairs: exactly the identity
        assert torch.equal(cos[:, 0, half:], torch.ones_like(cos[:, 0, half:]))
        assert torch.equal(sin[:, 0, half:], torch.zeros_like(sin[:, 0, half:]))


def test_partial_rotary_permutation_is_full_width_rope() -> None:
    """rotate_half over the permuted head == transformers' partial rotation, then permuted."""
    head_dim, rotary_dim = 16, 12
    perm = rope.partial_rotary_permutation(head_dim, rotary_dim)
    assert sorted(perm.tolist()) == list(range(head_dim))
    x = torch.randn(5, 3, head_dim)
    angle = torch.rand(5, 1, rotary_dim // 2) * 6
    # transformers: rotate pairs (j, j + 6) of the first 12 dims, pass the rest.
    rot, pass_ = x[..., :rotary_dim], x[..., rotary_dim:]
    r1, r2 = rot.chunk(2, dim=-1)
    cos, sin = angle.cos(), angle.sin()
    want = torch.cat((r1 * cos - r2 * sin, r2 * cos + r1 * sin, pass_), dim=-1)
    ones, zeros = torch.ones(5, 1, 2), torch.zeros(5, 1, 2)
    from onecall.model.layers import apply_rope

    got = apply_rope(x[..., perm], torch.cat((cos, ones), -1), torch.cat((sin, zeros), -1))
    torch.testing.assert_close(got, want[..., perm])


# ---------------------------------------------------------------- 2. models

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager",
)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL})),
    "llama_linear": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=1e4)),
    "qwen2_yarn": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1e4, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})),
    "phi3_longrope_partial": (Phi3Config, Phi3ForCausalLM, dict(
        pad_token_id=0, eos_token_id=2, partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                         "short_factor": factors(6, 1.0, 1.5, 4), "long_factor": factors(6, 1.0, 12.0, 5)})),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, head_dim=32, rope_theta=1e6)),
    # MistralConfig's default window (4096) covers the whole context (256): plain causal attention.
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(head_dim=16, rope_theta=1e4)),
    # a window shorter than the sequences here: every layer sees its last 8 positions only
    "mistral_sliding": (MistralConfig, MistralForCausalLM, dict(head_dim=16, rope_theta=1e4, sliding_window=8)),
}  # fmt: skip


@dataclasses.dataclass
class Models:
    hf: Any
    ours: DecoderLM


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request: pytest.FixtureRequest) -> Models:
    config_cls, model_cls, extra = FAMILIES[request.param]
    hf, ours = hf_and_ours(config_cls(**_COMMON, **extra), model_cls, weight_scale=0.15)
    return Models(hf, ours)


def test_prefill_past_the_original_context(models: Models) -> None:
    seq = Seq(prompt(2 * ORIGINAL + 5, seed=10))
    (logits,) = Harness(models.ours).step([(seq, len(seq.tokens))])
    assert_close(logits, hf_logits(models.hf, seq.tokens))


def test_decode_across_the_original_context(models: Models) -> None:
    harness = Harness(models.ours)
    seq = Seq(prompt(ORIGINAL + 3, seed=11))  # longrope: transformers' long set from here on
    (logits,) = harness.step([(seq, len(seq.tokens))])
    steps = []
    for _ in range(ORIGINAL):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    ref = hf_logits(models.hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[ORIGINAL + 3 + i])


def test_prefix_cache_hit(models: Models) -> None:
    harness = Harness(models.ours)
    a = Seq(prompt(ORIGINAL + 8, seed=12))
    harness.step([(a, len(a.tokens))])
    shared = ORIGINAL + 4  # whole blocks (block size 4): b reuses a's first blocks as they are
    b = Seq(a.tokens[:shared] + prompt(9, seed=13), num_cached=shared)
    b.block_table = a.block_table[: shared // 4]
    (logits,) = harness.step([(b, len(b.tokens) - shared)])
    assert_close(logits, hf_logits(models.hf, b.tokens)[shared:])


def test_longrope_short_factors_for_a_short_context() -> None:
    """A table that serves at most original positions runs the short set, as transformers does for
    every sequence that fits in the original context."""
    config_cls, model_cls, extra = FAMILIES["phi3_longrope_partial"]
    hf, ours = hf_and_ours(config_cls(**_COMMON, **extra), model_cls, weight_scale=0.15)
    short = DecoderLM(dataclasses.replace(ours.config, max_position_embeddings=ORIGINAL))
    load_weights(short, hf.state_dict().items())
    seq = Seq(prompt(ORIGINAL, seed=14))
    (logits,) = Harness(short).step([(seq, ORIGINAL)])
    assert_close(logits, hf_logits(hf, seq.tokens))
    (long_logits,) = Harness(ours).step([(Seq(list(seq.tokens)), ORIGINAL)])
    assert (long_logits - logits).abs().max() > 1e-2  # the factor sets do differ


def test_phi3_checkpoint_holds_fused_tensors() -> None:
    config_cls, model_cls, extra = FAMILIES["phi3_longrope_partial"]
    hf, ours = hf_and_ours(config_cls(**_COMMON, **extra), model_cls, weight_scale=0.15)
    names = set(hf.state_dict())
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in names
        and "model.layers.0.mlp.gate_up_proj.weight" in names
    )
    assert (ours.config.architecture, ours.config.rotary_dim, ours.config.head_dim) == ("phi3", 12, 16)
    # The o_proj and v rows are stored as they are; only q/k heads are permuted (rope.py).
    v_rows = slice(64 + 32, 64 + 64)
    torch.testing.assert_close(
        ours.model.layers[0].self_attn.qkv_proj.weight[v_rows],
        hf.state_dict()["model.layers.0.self_attn.qkv_proj.weight"][v_rows],
    )


# ---------------------------------------------------------------- 3. GGUF


def test_gguf_llama3_round_trip(tmp_path: Path) -> None:
    config_cls, model_cls, extra = FAMILIES["llama3"]
    hf_config = config_cls(**_COMMON, **extra)
    hf, _ = hf_and_ours(hf_config, model_cls, weight_scale=0.15)
    d = hf_config.to_dict()
    d["rope_theta"] = 1e4
    path = write_tiny_gguf(
        tmp_path / "llama3.gguf",
        hf.state_dict(),
        d,
        extra_tensors={"rope_freqs.weight": llama3_rope_freqs(d)},
    )
    files = resolve_model(path)
    config = model_config_from_hf(load_hf_config_dict(files))
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    assert config.rope_scaling.freq_factors is not None
    ours = DecoderLM(config)
    load_weights(ours, iter_weights(files, torch.float32))
    seq = Seq(prompt(2 * ORIGINAL + 5, seed=15))
    (logits,) = Harness(ours).step([(seq, len(seq.tokens))])
    assert_close(logits, hf_logits(hf, seq.tokens))


def test_gguf_yarn_and_linear_metadata(tmp_path: Path) -> None:
    from tests.helpers.make_models import random_state_dict, tiny_hf_config

    d = tiny_hf_config("qwen2")
    state = random_state_dict(d)
    yarn = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 64, "qwen2.rope.scaling.yarn_beta_fast": 24.0}  # fmt: skip
    config = model_config_from_hf(
        load_hf_config_dict(
            resolve_model(write_tiny_gguf(tmp_path / "y.gguf", state, d, extra_metadata=yarn))
        )
    )
    assert config.rope_scaling is not None
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("yarn", 4.0)
    assert (config.rope_scaling.original_max_position_embeddings, config.rope_scaling.beta_fast) == (64, 24.0)
    linear = {"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0}
    config = model_config_from_hf(
        load_hf_config_dict(
            resolve_model(write_tiny_gguf(tmp_path / "l.gguf", state, d, extra_metadata=linear))
        )
    )
    assert config.rope_scaling is not None and (
        config.rope_scaling.rope_type,
        config.rope_scaling.factor,
    ) == (
        "linear",
        2.0,
    )


def test_fast_kernels_run_partial_rotary_and_scaling() -> None:
    """The native path reads the same tables (rope_store here; the one-call decode step, which needs
    4-bit weights, gets the same cos/sin rows): partial rotary and longrope need nothing of it beyond
    them (the permuted head layout is plain full-width RoPE)."""
    from onecall.kernels.cpu import native
    from onecall.loading.packing import enable_fast_kernels
    from tests.helpers.make_models import fast_copy

    if native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    config_cls, model_cls, extra = FAMILIES["phi3_longrope_partial"]
    hf, ref = hf_and_ours(config_cls(**_COMMON, **extra), model_cls, weight_scale=0.15)
    ours = fast_copy(ref)
    enable_fast_kernels(ours)
    assert all(layer.self_attn.ops.name == "native" for layer in ours.model.layers)  # rope_store in use
    harness = Harness(ours)
    seq = Seq(prompt(ORIGINAL + 3, seed=16))
    (logits,) = harness.step([(seq, len(seq.tokens))], num_decode=0)
    steps = []
    for _ in range(6):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)], num_decode=1)
        steps.append(logits[-1])
    ref = hf_logits(hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[ORIGINAL + 3 + i])
