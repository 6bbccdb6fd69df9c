"""Gemma 4's text model (model/gemma4.py) against transformers' Gemma4ForCausalLM, float32 on CPU.

Tiny random-weight models (hidden 64, 4 query heads, sliding layers 2 KV heads of 16, window 6,
vocabulary 512, eager attention) built by transformers, loaded into ours through model_config_from_hf
(on transformers' own config dict) and load_weights (on its state dict), run through the paged cache
(block size 4, scrambled blocks) sized by ModelConfig.num_kv_layers as the engine sizes it. Three
variants make every Gemma 4 piece bite:

| variant | what it has                                                                                   |
|---------|-----------------------------------------------------------------------------------------------|
| e2b     | per-layer inputs (8 wide), the last 2 of 6 layers sharing K/V, double-wide MLPs there, global |
|         | layers of head_dim 32 with 2 KV heads (cache row 64: sliding layers store each head twice),    |
|         | proportional RoPE (a quarter of the pairs, factor 2), final soft-cap 3                         |
| 31b     | attention_k_eq_v (global layers: V = K's projection), 1 global KV head of 32, untied lm_head   |
| moe     | 26B-A4B's MoE block beside each dense MLP (4 experts, top 2), K = V                            |

Every norm weight is 1 + 0.2 N (Gemma 4's norms scale by w itself: nothing is folded), layer_scalar
0.5 .. 1.5, every other weight 0.15 N.

Tolerances (measured max abs diff; logits capped at 3 (e2b) or up to ~5.3):
- ours against transformers, 20-token prefill and 6 greedy decode steps: ATOL 2e-4, measured prefill
  7.7e-6 (e2b), 2.2e-5 (31b), 1.2e-5 (moe), decode 6.6e-5 (e2b), 1.0e-5 (31b), 7.6e-6 (moe). Float32
  both sides; the differences are summation order (SDPA and the native attention kernels against
  eager softmax, F.rms_norm against transformers' pow(-0.5)), amplified by Gemma 4's attention scale
  1.0 over normed q and k (sharp softmaxes): transformers' own float32 logits are 5.1e-5 (e2b) and
  2.5e-5 (31b) from its float64 ones, so this is float32 noise, not a formula (dropping layer_scalar,
  v_norm or the proportional RoPE's factor each moves the logits by > 1).
- chunked prefill (7 + 6 + 7 rows) against one chunk: 3e-5, measured 3.8e-6 (e2b), 0 (31b), 7.2e-6 (moe).
- the fast kernels (DecoderLM(kernels="fast") with its projections packed on oneDNN, and the native
  attention kernels that the reference build's "paged" steps also run) against the reference build:
  ATOL, measured 0 (oneDNN's float32 products are torch's here).
- the multimodal checkpoint's language model against Gemma4ForConditionalGeneration: ATOL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.config import GLOBAL, SLIDING
from onecall.model.decoder import DecoderLM
from tests.helpers.family_checks import (
    KVHarness,
    assert_close,
    check_batched_decode_on_reference,
    check_chunked_prefill,
    check_engine_generates_as_transformers,
    check_prefill_then_decode,
    randomize,
)
from tests.model.test_model_numerics import VOCAB, Seq, hf_logits, prompt

ATOL = 2e-4
CHUNK_ATOL = 3e-5

pytestmark = pytest.mark.usefixtures("single_thread")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6, max_position_embeddings=256,
    layer_types=[SLIDING, GLOBAL, SLIDING, GLOBAL, SLIDING, GLOBAL], attn_implementation="eager",
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                     GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0,
                              "rope_theta": 1e6}},
)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "e2b": dict(
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=3.0,
    ),
    "31b": dict(
        hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False,
    ),
    "moe": dict(
        hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=24,
    ),
}  # fmt: skip


def build(variant: str, seed: int = 0) -> tuple[Any, DecoderLM]:
    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**_COMMON, **VARIANTS[variant])).eval()
    randomize(hf)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1))
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return hf, ours.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request: pytest.FixtureRequest) -> tuple[Any, DecoderLM]:
    return build(request.param)


def test_prefill_and_decode_match_transformers(models: tuple[Any, DecoderLM]) -> None:
    """20-token prefill (past the 6-token window), then 6 greedy decode steps through the paged cache."""
    check_prefill_then_decode(*models, ATOL)


def test_batched_decode_and_reference_backend(models: tuple[Any, DecoderLM]) -> None:
    check_batched_decode_on_reference(*models, ATOL)


def test_chunked_prefill_equals_one_chunk(models: tuple[Any, DecoderLM]) -> None:
    check_chunked_prefill(models[1], CHUNK_ATOL)


def test_fast_kernels_match_the_reference(models: tuple[Any, DecoderLM]) -> None:
    """DecoderLM(kernels="fast") with its projections packed (loading/packing.py) against ours."""
    from onecall.loading.packing import enable_fast_kernels
    from tests.helpers.make_models import fast_copy

    _, ours = models
    fast = fast_copy(ours)
    enable_fast_kernels(fast)
    assert fast.native_step is None
    seq, ref_seq = Seq(prompt(21, seed=5)), Seq(prompt(21, seed=5))
    fast_harness, ref_harness = KVHarness(fast), KVHarness(ours)
    (got,) = fast_harness.step([(seq, 21)])
    (want,) = ref_harness.step([(ref_seq, 21)])
    assert_close(got, want, ATOL)
    for token in (3, 9):
        seq.tokens.append(token)
        ref_seq.tokens.append(token)
        (got,) = fast_harness.step([(seq, 1)])
        (want,) = ref_harness.step([(ref_seq, 1)])
        assert_close(got, want, ATOL)


def test_kv_pool_holds_no_cache_for_shared_layers() -> None:
    """e2b: layers 4 and 5 reuse layers 2 and 3's K/V (transformers' "store" layers): 4 cache layers
    for 6 layers, the sharing layers have no k/v projections, and a pool of exactly 4 layers runs."""
    hf, ours = build("e2b")
    spec = ours.config.gemma4
    assert spec is not None
    assert ours.config.num_kv_layers == 4 < ours.config.num_hidden_layers
    modes = hf.config.kv_sharing_modes
    stores = {hf.config.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    for i, layer in enumerate(ours.model.layers):
        attn = layer.self_attn
        if modes[i] == "reuse":
            assert not attn.writes and attn.k_proj is None and attn.v_proj is None
            assert attn.cache_layer == stores[hf.config.layer_types[i]]
            assert layer.mlp.gate_proj.out_features == 2 * ours.config.intermediate_size  # double-wide
        else:
            assert attn.writes and attn.cache_layer == i
    # the cache row is the widest layer's (global: 2 x 32); sliding layers (2 x 16) store each head twice
    assert ours.config.num_key_value_heads * ours.config.head_dim == spec.cache_width == 64
    assert [spec.kv_repeat(i) for i in range(6)] == [2, 1, 2, 1, 2, 1]
    # a checkpoint that still holds the sharing layers' K/V projections and norms loads (they are dropped)
    extra = [
        (f"model.layers.{i}.self_attn.{m}.weight", torch.zeros(1))
        for i in (4, 5)
        for m in ("k_proj", "k_norm")
    ]
    again = DecoderLM(ours.config)
    load_weights(again, [*hf.state_dict().items(), *extra])
    assert torch.equal(
        again.model.layers[3].self_attn.k_proj.weight, ours.model.layers[3].self_attn.k_proj.weight
    )
    harness = KVHarness(ours)
    assert harness.kv_cache.k.shape[0] == 4
    seq = Seq(prompt(10, seed=8))
    (logits,) = harness.step([(seq, 10)])
    assert_close(logits, hf_logits(hf, seq.tokens), ATOL)


def test_gemma4_configs_as_their_files_write_them() -> None:
    """A config.json as the hub writes it (global_head_dim, num_global_key_value_heads, no
    per_layer_config), the multimodal wrapper's text_config, and the refusals."""
    e2b_like = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 16, "global_head_dim": 32, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 1024,
    }  # fmt: skip
    c = model_config_from_hf(e2b_like)
    spec = c.gemma4
    assert spec is not None and c.architecture == "gemma4" and c.tie_word_embeddings
    assert spec.layer_types == (SLIDING,) * 5 + (GLOBAL, SLIDING, GLOBAL)  # 5:1, the last layer forced global
    assert (spec.global_head_dim, spec.global_kv_heads) == (32, 1)  # no k_eq_v: the sliding KV heads
    assert (spec.global_rope_proportion, spec.global_rope_theta, spec.sliding_rope_theta) == (0.25, 1e6, 1e4)
    assert (
        c.num_kv_layers == 6
        and spec.cache_layer(6) == 4
        and spec.cache_layer(7) == 5
        and spec.cache_width == 32
        and (c.num_key_value_heads, c.head_dim) == (2, 16)
    )
    wide = model_config_from_hf({**e2b_like, "attention_k_eq_v": True, "num_global_key_value_heads": 4})
    assert wide.gemma4 is not None and wide.gemma4.global_kv_heads == 4 and wide.gemma4.cache_width == 128
    from onecall.model.config import ModelConfig

    assert ModelConfig(**c.to_dict()) == c  # the nested Gemma4Spec survives a dict round trip
    multimodal = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "text_config": {k: v for k, v in e2b_like.items() if k != "architectures"},
                  "vision_config": {"hidden_size": 32}}  # fmt: skip
    assert model_config_from_hf(multimodal) == c
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn' for full_attention"):
        model_config_from_hf({**e2b_like, "rope_parameters": {SLIDING: {"rope_type": "default"},
                                                               GLOBAL: {"rope_type": "yarn", "factor": 2.0}}})  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu'"):
        model_config_from_hf({**e2b_like, "hidden_activation": "silu"})
    with pytest.raises(UnsupportedModelError, match="num_kv_shared_layers"):
        model_config_from_hf({**e2b_like, "num_kv_shared_layers": 8})
    with pytest.raises(UnsupportedModelError, match="no earlier layer of its type"):
        model_config_from_hf({**e2b_like, "layer_types": [SLIDING] * 6 + [GLOBAL] * 2})


def test_parameter_count_is_transformers(models: tuple[Any, DecoderLM]) -> None:
    """ModelConfig.num_parameters: transformers' parameters (tied embeddings once) plus the layer_scalar
    buffers, which are parameters here; and ours, built, hold exactly that many."""
    hf, ours = models
    theirs = sum(p.numel() for p in hf.parameters()) + hf.config.num_hidden_layers
    assert ours.config.num_parameters == theirs == sum(p.numel() for p in ours.parameters())


def test_the_multimodal_checkpoints_language_model() -> None:
    """Gemma4ForConditionalGeneration (tiny vision and audio towers): its config's text_config and its
    tensors renamed by formats/checkpoint.py (towers and their embedders skipped) give the text model,
    whose logits on a text-only prompt are transformers' own (ATOL)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from onecall.formats.checkpoint import language_model_tensor

    text = {k: v for k, v in {**_COMMON, **VARIANTS["e2b"]}.items() if k != "attn_implementation"}
    config = Gemma4Config(
        text_config=text,
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64),
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32),
    )  # fmt: skip
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    ours = DecoderLM(
        model_config_from_hf({**config.to_dict(), "architectures": ["Gemma4ForConditionalGeneration"]})
    )
    renamed = ((language_model_tensor(n), t) for n, t in hf.state_dict().items())
    load_weights(ours, ((n, t) for n, t in renamed if n is not None))
    seq = Seq(prompt(12, seed=9))
    (logits,) = KVHarness(ours.eval()).step([(seq, 12)])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([seq.tokens]), use_cache=False).logits[0].float()
    assert_close(logits, ref, ATOL)


def test_the_capturable_expert_sum_is_the_routed_one() -> None:
    """Gemma4Experts.every_expert (what a CUDA graph runs: no host sync) against forward's loop over
    the experts tokens picked: the same sum, to float32 summation order (measured ~1e-7)."""
    from onecall.model.gemma4 import Gemma4Experts, Gemma4Router

    _, ours = build("moe")
    layer = ours.model.layers[0]
    assert isinstance(layer.router, Gemma4Router) and isinstance(layer.experts, Gemma4Experts)
    x = torch.randn(9, ours.config.hidden_size, generator=torch.Generator().manual_seed(2))
    weights, ids = layer.router(x)
    routed, dense = layer.experts(x, weights, ids), layer.experts.every_expert(x, weights, ids)
    assert (routed - dense).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", ["e2b", "moe"])
def test_the_engine_generates_what_transformers_does(variant: str, tmp_path: Any) -> None:
    """A saved Gemma 4 folder through LLM (the engine: its KV pool of num_kv_layers, scheduler, paged
    cache, sampler), greedy, against transformers' generate: a 20-token prompt past the 6-token window,
    10 new tokens; then a second request that shares the first 16 tokens (a prefix-cache hit, so the
    KV-sharing layers read cached blocks they never wrote) and must generate as transformers does."""
    hf, _ = build(variant)
    check_engine_generates_as_transformers(hf, tmp_path, "gemma4")


def test_attention_probabilities_are_refused_by_name() -> None:
    """LLM.attention_probs' probe runs Llama-shaped layers only: Gemma 4's are refused with a typed
    error naming them (before its two-table RoPE is asked for one table)."""
    from onecall.model.attention_probe import last_position_attention

    _, ours = build("31b")
    with pytest.raises(UnsupportedModelError, match="Gemma4"):
        last_position_attention(ours, torch.tensor(prompt(5, seed=1)))
