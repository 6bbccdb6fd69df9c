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
