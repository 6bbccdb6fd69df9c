"""The mixture-of-experts block (model/moe.py) against transformers' Qwen3-MoE and Mixtral blocks.

Tolerance: 1e-5 absolute/relative in float32. Same weights, same routing (softmax in float32, top-k,
renormalised as each family does); the sums run in a different order (experts grouped per matmul,
index_add_ per expert), which moves float32 results by a few ulps, far below 1e-5 at these magnitudes.
Ties in the top-k would make the two pick different experts; random float inputs make them
vanishingly unlikely, and the seeds are fixed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from onecall.model.moe import SparseMoE, route

HIDDEN, INTER, EXPERTS = 32, 24, 8


def _ours_from(block: torch.nn.Module, top_k: int, norm_topk_prob: bool) -> SparseMoE:
    ours = SparseMoE(HIDDEN, INTER, EXPERTS, top_k, norm_topk_prob, torch.float32, "cpu")
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ours.experts.down_proj.copy_(block.experts.down_proj)
    return ours


def _randomise(block: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_qwen3_moe_block_matches_transformers(norm_topk_prob: bool, num_tokens: int) -> None:
    config = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(config)
    _randomise(block, seed=num_tokens)
    ours = _ours_from(block, 3, norm_topk_prob)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = block(x.unsqueeze(0)).squeeze(0)
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_mixtral_block_matches_transformers(num_tokens: int) -> None:
    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2
    )
    block = MixtralSparseMoeBlock(config).eval()  # eval: no router jitter
    _randomise(block, seed=11)
    ours = _ours_from(block, 2, norm_topk_prob=True)  # Mixtral always renormalises its top 2
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = block(x.unsqueeze(0)).squeeze(0)
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_route_picks_the_top_experts_and_renormalises() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, experts = route(logits, 2, norm_topk_prob=True)
    assert experts.tolist() == [[1, 2], [3, 0]]
    probs = torch.softmax(logits, dim=-1)
    want = torch.stack([probs[0, [1, 2]], probs[1, [3, 0]]])
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True))
    raw, _ = route(logits, 2, norm_topk_prob=False)
    torch.testing.assert_close(raw, want)


def test_a_token_reads_only_its_own_experts() -> None:
    """An expert no token was routed to never runs: poisoning its weights changes nothing."""
    ours = SparseMoE(HIDDEN, INTER, EXPERTS, 2, True, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = torch.randn(4, HIDDEN, generator=gen)
        before = ours(x)
        _, experts = route(ours.gate(x), 2, True)
        unused = sorted(set(range(EXPERTS)) - set(experts.flatten().tolist()))
        assert unused, "the seed routes every expert; pick another"
        ours.experts.gate_up_proj[unused] = float("nan")
        assert torch.equal(ours(x), before)


# ---------------------------------------------------------------- whole models, as a user loads them
# Qwen3-MoE (q/k norms; a dense layer among the sparse ones via mlp_only_layers) and Mixtral, from
# transformers' own config dict, loaded from its state dict (stacked experts, as transformers 5 holds
# them) and from per-expert tensors (as the files on disk store them: Mixtral's w1/w2/w3 names);
# prefill, paged decode and a prefix hit. Tolerance: test_model_numerics' ATOL on logits.
from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from onecall.formats.hf_config import model_config_from_hf  # noqa: E402
from onecall.loading.weights import load_weights  # noqa: E402
from onecall.model.decoder import DecoderLM  # noqa: E402
from tests.helpers.make_models import hf_and_ours  # noqa: E402
from tests.model.test_model_numerics import VOCAB, Harness, Seq, assert_close, hf_logits, prompt  # noqa: E402

_TINY = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
    max_position_embeddings=256, attn_implementation="eager",
)  # fmt: skip
WHOLE = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
}  # fmt: skip


def _per_expert(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts as the checkpoint files store them: one tensor per expert."""
    names = {
        "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
        "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    }
    block, gate, up, down = names[arch]
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("mlp.experts.gate_up_proj") + f"{block}.experts"
            for e, (g, u) in enumerate(t.chunk(2) for t in tensor):
                out[f"{base}.{e}.{gate}.weight"], out[f"{base}.{e}.{up}.weight"] = g, u
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("mlp.experts.down_proj") + f"{block}.experts"
            for e, d in enumerate(tensor):
                out[f"{base}.{e}.{down}.weight"] = d
        else:
            out[name.replace(".mlp.gate.", f".{block}.gate.")] = tensor
    return out


@pytest.mark.parametrize("arch", sorted(WHOLE))
def test_whole_moe_models_match_transformers(arch: str) -> None:
    config_cls, model_cls, extra = WHOLE[arch]
    hf, ours = hf_and_ours(config_cls(**_TINY, **extra), model_cls, weight_scale=0.15)
    assert ours.config.moe is not None
    if arch == "qwen3_moe":
        assert ours.config.moe.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    # the same model from per-expert tensors: the same parameters
    from_files = DecoderLM(model_config_from_hf(hf.config.to_dict()))
    load_weights(from_files, _per_expert(dict(hf.state_dict()), arch).items())
    for (name, a), (_, b) in zip(ours.named_parameters(), from_files.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    harness = Harness(ours)
    seq = Seq(prompt(19, seed=7))
    (logits,) = harness.step([(seq, 19)])
    assert_close(logits, hf_logits(hf, seq.tokens))
    steps = []
    for _ in range(4):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    ref = hf_logits(hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[19 + i])
    other = Seq(seq.tokens[:16] + prompt(3, seed=8), num_cached=16)
    other.block_table = seq.block_table[:4]
    (logits,) = harness.step([(other, 3)])
    assert_close(logits, hf_logits(hf, other.tokens)[16:])


def test_a_missing_expert_is_named() -> None:
    from onecall.errors import UnsupportedModelError

    config_cls, model_cls, extra = WHOLE["mixtral"]
    hf, _ = hf_and_ours(config_cls(**_TINY, **extra), model_cls, weight_scale=0.15)
    files = _per_expert(dict(hf.state_dict()), "mixtral")
    del files["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(UnsupportedModelError, match="layers.2.mlp.experts.down_proj"):
        load_weights(DecoderLM(model_config_from_hf(hf.config.to_dict())), files.items())


def test_the_fast_kernels_run_a_moe_model() -> None:
    """Attention projections on oneDNN, the experts dense (model/moe.py), no one-call decode step."""
    from onecall.loading.packing import enable_fast_kernels
    from tests.helpers.make_models import fast_copy

    config_cls, model_cls, extra = WHOLE["qwen3_moe"]
    _, ours = hf_and_ours(config_cls(**_TINY, **extra), model_cls, weight_scale=0.15)
    fast = fast_copy(ours)
    enable_fast_kernels(fast)
    assert fast.native_step is None and "onednn" in fast.kernels
    (got,) = Harness(fast).step([(Seq(prompt(19, seed=9)), 19)])
    (want,) = Harness(ours).step([(Seq(prompt(19, seed=9)), 19)])
    assert_close(got, want)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_stored_experts_run_on_their_own_groups(kind: str) -> None:
    """A quantized GGUF's experts (Experts.use_stored), in a step with 2 decode rows planned: int8
    and 4-bit groups alike run every row, decode and prompt, on their native kernel, and their float32
    copy is freed. The float32 weights were the groups' own values, so every row matches the reference
    to the int16 activation rounding; poisoning the stored groups then shows every row reads them."""
    from onecall.formats.quants import Int4Groups, Int8Groups
    from onecall.kernels.cpu import native
    from onecall.kernels.cpu.experts import native_experts
    from tests.helpers.int4 import quantize_int4, quantize_int8

    if native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    hidden, inter, num_experts = 64, 32, 6
    moe = SparseMoE(hidden, inter, num_experts, 2, True, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(5)
    quantize = quantize_int8 if kind == "int8" else quantize_int4
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(num_experts, hidden, generator=gen))
        gate_up = [quantize(torch.randn(2 * inter, hidden, generator=gen) * 0.2) for _ in range(num_experts)]
        down = [quantize(torch.randn(hidden, inter, generator=gen) * 0.2) for _ in range(num_experts)]
        moe.experts.gate_up_proj.copy_(torch.stack([g.dequantize() for g in gate_up]))
        moe.experts.down_proj.copy_(torch.stack([g.dequantize() for g in down]))
        x = torch.randn(7, hidden, generator=gen)
        ref = moe(x)  # nothing stored: float32 for every row
        shapes = moe.experts.weight_shapes
        assert moe.experts.use_stored(native_experts(gate_up, down, shapes)) and moe.experts.stored is not None
        assert moe.experts.gate_up_proj.numel() == 0 and moe.experts.down_proj.numel() == 0  # freed
        got = moe(x, 2)
        # both kinds round activations to int16 steps per group of 32 (measured here: up to 1.1e-4 for
        # int8 groups, 8e-4 for 4-bit ones; about 2-4x allowed)
        tol = 5e-4 if kind == "int8" else 2e-3
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        poisoned_gate_up = [
            Int8Groups(g.q, g.scale * 0, g.group_size) if isinstance(g, Int8Groups) else
            Int4Groups(g.q, g.scale * 0, g.offset * 0, g.group_size) for g in gate_up
        ]  # fmt: skip
        # bytes one decode row streams: the router and top_k experts in their stored form
        one_expert = sum(moe.experts.stored.nbytes(0, which) or 0 for which in (0, 1))
        assert one_expert > 0
        assert moe.weight_bytes_read(1) == 4 * hidden * num_experts + 2 * one_expert
        moe.experts.use_stored(native_experts(poisoned_gate_up, down, shapes))
        poisoned = moe(x, 2)
        assert not torch.allclose(poisoned[:2], ref[:2], atol=1e-2)  # decode rows read the groups
        assert not torch.allclose(poisoned[2:], ref[2:], atol=1e-2)  # and so do prompt rows


def test_the_bandwidth_figure_counts_the_experts_a_step_reaches() -> None:
    """packing.weight_bytes_read on a whole Qwen3-MoE model (top 2 of 6 experts, sparse layers 0 and 2):
    one decode row streams 2/6 of each sparse layer's experts, so the figure is every parameter's bytes
    less 4/6 of the experts'; 3 rows can reach every expert and count every parameter. Experts whose
    4-bit groups replaced their float32 copy (freed) count in the groups' bytes, not as nothing."""
    from onecall.loading.packing import weight_bytes_read

    config_cls, model_cls, extra = WHOLE["qwen3_moe"]
    _, ours = hf_and_ours(config_cls(**_TINY, **extra), model_cls, weight_scale=0.15)
    assert ours.lm_head is not None  # untied: the embedding table is gathered from, not streamed

    def dense() -> int:
        params = dict(ours.named_parameters())
        del params["model.embed_tokens.weight"]
        return sum(p.numel() * p.element_size() for p in params.values())

    moes = [m for m in ours.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == 2
    float_experts = [sum(p.numel() * 4 for p in m.experts.parameters()) for m in moes]
    assert weight_bytes_read(ours, 1) == dense() - sum(b * 4 // 6 for b in float_experts)
    assert weight_bytes_read(ours, 3) == dense()

    from onecall.kernels.cpu import native
    from onecall.kernels.cpu.experts import native_experts
    from tests.helpers.int4 import quantize_int4

    if native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    experts = moes[0].experts
    with torch.no_grad():
        gate_up = [quantize_int4(w) for w in experts.gate_up_proj]
        down = [quantize_int4(w) for w in experts.down_proj]
    held = native_experts(gate_up, down, experts.weight_shapes)
    assert experts.use_stored(held) and experts.gate_up_proj.numel() == 0
    assert held is not None and held.kinds() == {"int4"}
    one_expert = sum(held.nbytes(0, which) or 0 for which in (0, 1))
    assert one_expert > 0
    # layer 0: its 2 reachable experts' groups (its float32 weights are gone from dense());
    # layer 2: still 2/6 of its float32 experts
    assert weight_bytes_read(ours, 1) == dense() + 2 * one_expert - float_experts[1] * 4 // 6


def test_a_moe_model_gets_no_static_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE layer reads its expert counts on the host (.tolist()), which no CUDA graph can capture: the
    engine keeps such a model on eager steps even where it would set static ones up (the Triton backend,
    as on CUDA), instead of failing a capture per layout."""
    from onecall.engine import engine as engine_module
    from tests.helpers.tiny_engine import tiny_engine, tiny_model

    monkeypatch.setattr(engine_module, "default_backend", lambda device, kernels, **_: "triton")
    config_cls, model_cls, extra = WHOLE["qwen3_moe"]
    _, moe = hf_and_ours(
        config_cls(**{**_TINY, "vocab_size": tiny_model().config.vocab_size}, **extra),
        model_cls,
        weight_scale=0.15,
    )
    assert moe.config.moe is not None
    assert tiny_engine(model=moe, cuda_graphs=True).runner.decode_graphs is None
    assert tiny_engine(arch="qwen3", cuda_graphs=True).runner.decode_graphs is not None  # a dense one does
