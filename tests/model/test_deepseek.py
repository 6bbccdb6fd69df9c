"""DeepSeek-V3 (model/deepseek.py: multi-head latent attention over a latent cache, the grouped sigmoid
router) against transformers' DeepseekV3ForCausalLM, float32 on CPU.

Tiny random-weight models (hidden 64, 4 heads, kv_lora_rank 32, qk_rope_head_dim 8, qk_nope_head_dim 16,
v_head_dim 16, 8 routed experts in 4 groups (topk_group 2, top 2, routed_scaling_factor 2.5), 1 shared
expert, first_k_dense_replace 1 of 3 layers, vocabulary 512, eager attention) built by transformers,
loaded through model_config_from_hf (its own config dict) and load_weights (its state dict), run through
the paged cache (block size 4, scrambled blocks) as the engine sizes it:

| variant | what it has                                                                              |
|---------|------------------------------------------------------------------------------------------|
| lora    | q_lora_rank 24 (q_a_proj, q_a_layernorm, q_b_proj), interleaved RoPE (rope_interleave)    |
| plain   | q_proj (q_lora_rank null), rotate-half RoPE, yarn (factor 4, mscale_all_dim 1: the scale |
|         | changes), an attention bias, tied embeddings                                             |

Norm weights 1 + 0.2 N, e_score_correction_bias 0.3 N (so it changes the choice), every other weight 0.15 N.

Tolerances (max abs diff of logits, which reach ~4.8; measured on this machine):
- ours against transformers, 20-token prefill and 6 greedy decode steps: ATOL 2e-4, measured prefill
  5.0e-6 (lora), 4.8e-6 (plain), decode 5.5e-6 (lora), 5.3e-6 (plain). Float32 both sides; the
  difference is summation order (einsums over the latents against transformers' per-head matmuls).
- chunked prefill (7 + 6 + 7 rows) against one chunk: CHUNK_ATOL 3e-5, measured 4.3e-6 / 4.5e-6.
- absorbed (kv_b_proj folded into q and the output) against decompressed attention, every row of a
  20-token prefill and 4 decode steps: CHUNK_ATOL, measured 4.1e-6 / 7.2e-6 (the same sums, other order).
- the engine test compares greedy tokens exactly (transformers' generate).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from onecall.errors import UnsupportedModelError
from onecall.formats.hf_config import model_config_from_hf
from onecall.loading.weights import load_weights
from onecall.model.config import ModelConfig
from onecall.model.decoder import DecoderLM
from onecall.model.deepseek import set_mla_mode
from tests.helpers.family_checks import (
    KVHarness,
    assert_close,
    check_batched_decode_on_reference,
    check_chunked_prefill,
    check_engine_generates_as_transformers,
    check_prefill_then_decode,
    randomize,
)
from tests.model.test_model_numerics import VOCAB, Seq, prompt

ATOL = 2e-4
CHUNK_ATOL = 3e-5

pytestmark = pytest.mark.usefixtures("single_thread")

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=256, attn_implementation="eager",
)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "lora": dict(q_lora_rank=24, rope_interleave=True),
    "plain": dict(
        q_lora_rank=None, rope_interleave=False, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "rope_theta": 10000.0},
    ),
}  # fmt: skip


def build(variant: str, seed: int = 0) -> tuple[Any, DecoderLM]:
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**_COMMON, **VARIANTS[variant])).eval()
    randomize(hf)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    ours = DecoderLM(model_config_from_hf(hf.config.to_dict()), dtype=torch.float32, device="cpu")
    load_weights(ours, hf.state_dict().items())
    return hf, ours.eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request: pytest.FixtureRequest) -> tuple[Any, DecoderLM]:
    return build(request.param)


def test_prefill_and_decode_match_transformers(models: tuple[Any, DecoderLM]) -> None:
    """20-token prefill, then 6 greedy decode steps through the paged (latent) cache."""
    check_prefill_then_decode(*models, ATOL)


def test_batched_decode_and_reference_backend(models: tuple[Any, DecoderLM]) -> None:
    check_batched_decode_on_reference(*models, ATOL)


def test_chunked_prefill_equals_one_chunk(models: tuple[Any, DecoderLM]) -> None:
    check_chunked_prefill(models[1], CHUNK_ATOL)


def test_absorbed_equals_decompressed(models: tuple[Any, DecoderLM]) -> None:
    """Every row (a prefill chunk too) in the absorbed form against every row decompressed."""
    _, ours = models
    outs = {}
    try:
        for mode in ("decompressed", "absorbed"):
            set_mla_mode(ours, mode)
            harness, seq = KVHarness(ours), Seq(prompt(20, seed=7))
            rows = [harness.step([(seq, 20)])[0]]
            for token in (3, 9, 27, 81):
                seq.tokens.append(token)
                rows.append(harness.step([(seq, 1)])[0])
            outs[mode] = torch.cat(rows)
    finally:
        set_mla_mode(ours, "auto")
    assert_close(outs["absorbed"], outs["decompressed"], CHUNK_ATOL)


def test_the_cache_holds_the_latent_row(models: tuple[Any, DecoderLM]) -> None:
    """One KV head of half the latent row (32 + 8 = 40 floats: 20 in K, 20 in V), a layer per layer."""
    _, ours = models
    c = ours.config
    spec = c.deepseek
    assert spec is not None
    assert (c.num_key_value_heads, c.head_dim, c.num_kv_layers) == (1, 20, 3)
    assert 2 * c.num_key_value_heads * c.head_dim == spec.latent_width == 40
    harness, seq = KVHarness(ours), Seq(prompt(5, seed=2))
    harness.step([(seq, 5)])
    slot = seq.block_table[0] * 4  # position 0
    attn = ours.model.layers[0].self_attn
    x = ours.model.layers[0].input_layernorm(ours.model.embed_tokens(torch.tensor(seq.tokens[:1])))
    c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, :32])
    row = torch.cat((harness.kv_cache.k[0, slot, 0], harness.kv_cache.v[0, slot, 0]))
    assert torch.allclose(row[:32], c_kv[0], atol=1e-6)
    k_pe = attn.kv_a_proj_with_mqa(x)[0, 32:]  # position 0: not rotated; interleaved: [evens | odds]
    k_pe = torch.cat((k_pe[0::2], k_pe[1::2])) if spec.rope_interleave else k_pe
    assert torch.allclose(row[32:], k_pe, atol=1e-6)


def test_parameter_count_is_transformers(models: tuple[Any, DecoderLM]) -> None:
    """num_parameters: transformers' parameters (tied embeddings once) plus the e_score_correction_bias
    buffers (parameters here); ours, built, hold exactly that many."""
    hf, ours = models
    buffers = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    theirs = sum(p.numel() for p in hf.parameters()) + buffers
    assert ours.config.num_parameters == theirs == sum(p.numel() for p in ours.parameters())


def test_configs_as_their_files_write_them() -> None:
    """DeepSeek-V3's config.json keys (defaults where absent), a dict round trip, MTP tensors skipped,
    and the refusals by name."""
    d = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1024,
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 4,
        "num_attention_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
        "kv_lora_rank": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 1,
    }  # fmt: skip
    c = model_config_from_hf(d)
    assert c.architecture == "deepseek_v3" and c.moe is not None and c.deepseek is not None
    assert c.moe.sparse_layers == (False, True, True, True) and c.moe.shared_expert_intermediate_size == 24
    assert c.deepseek.routed_scaling_factor == 2.5 and c.rope_scaling is None and not c.tie_word_embeddings
    assert ModelConfig(**c.to_dict()) == c
    with pytest.raises(UnsupportedModelError, match="topk_method 'greedy'"):
        model_config_from_hf({**d, "topk_method": "greedy"})
    with pytest.raises(UnsupportedModelError, match="scoring_func 'softmax'"):
        model_config_from_hf({**d, "scoring_func": "softmax"})
    with pytest.raises(UnsupportedModelError, match="rope_type 'linear'"):
        model_config_from_hf({**d, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(UnsupportedModelError, match="missing its multi-head latent attention keys: kv_lora_rank"):
        model_config_from_hf({k: v for k, v in d.items() if k != "kv_lora_rank"})
    with pytest.raises(UnsupportedModelError, match="n_shared_experts 0"):
        model_config_from_hf({**d, "n_shared_experts": 0})
    with pytest.raises(UnsupportedModelError, match="does not run under tensor parallel"):
        from onecall.model.parallel import TensorParallel

        DecoderLM(c, tp=TensorParallel(rank=0, world_size=2))
    # an MTP layer's tensors (model.layers.{num_hidden_layers}.*) are skipped on load
    hf, ours = build("lora")
    mtp = [("model.layers.3.eh_proj.weight", torch.zeros(2, 2)), ("model.layers.3.enorm.weight", torch.zeros(2))]
    again = DecoderLM(ours.config)
    load_weights(again, [*hf.state_dict().items(), *mtp])


def test_per_expert_checkpoint_tensors_load() -> None:
    """A checkpoint with one tensor per expert (as DeepSeek's own files are) loads as the stacked one."""
    hf, ours = build("lora")
    per_expert: list[tuple[str, torch.Tensor]] = []
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                per_expert += [(f"{base}.{e}.gate_proj.weight", t[e, :inter]), (f"{base}.{e}.up_proj.weight", t[e, inter:])]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix(".down_proj")
            per_expert += [(f"{base}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            per_expert.append((name, t))
    again = DecoderLM(ours.config)
    load_weights(again, per_expert)
    for (n1, p1), (_, p2) in zip(again.named_parameters(), ours.named_parameters(), strict=True):
        assert torch.equal(p1, p2), n1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_engine_generates_what_transformers_does(variant: str, tmp_path: Any) -> None:
    """A saved DeepSeek-V3 folder through LLM (the engine: its latent KV pool, scheduler, sampler),
    greedy, against transformers' generate: a 20-token prompt, 10 new tokens; then a second request
    sharing the first 16 tokens (a prefix-cache hit: its attention reads latent rows it never wrote)."""
    hf, _ = build(variant)
    config, info = check_engine_generates_as_transformers(hf, tmp_path, "deepseek_v3")
    assert info.kv_bytes_per_token == config.num_hidden_layers * 40 * 4  # the latent row, float32


def test_latent_attention_takes_the_paged_backend_on_every_device() -> None:
    """MLA attends in its own torch code over each sequence's cache rows, which the Triton backend's
    metadata (block tables as tensors) does not carry: a DeepSeek model gets "paged" even on CUDA."""
    from onecall.model.attention_metadata import default_backend

    assert default_backend("cuda", "fast", latent_attention=True) == "paged"
    assert default_backend("cpu", "fast", latent_attention=True) == "paged"
