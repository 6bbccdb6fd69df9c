"""The attention-probabilities path (model/attention_probe.py) against transformers' eager attention.

Tiny random-weight Llama (with q/k/v bias) and Qwen3 (q/k norm) models are built with transformers
(attn_implementation="eager", output_attentions=True), their weights loaded into our DecoderLM, and
the last position's attention, averaged over heads, compared layer by layer. Every norm and bias is
randomised so it counts, and GQA is on (4 query heads over 2 KV heads).
Tolerance: max abs diff <= 1e-5 on probabilities (float32 on CPU; the only differences are
summation order in the matmuls). Rows must sum to 1 within 1e-5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from onecall.model.attention_probe import last_position_attention
from onecall.model.decoder import DecoderLM
from tests.helpers.make_models import hf_and_ours

if TYPE_CHECKING:
    from onecall.llm import LLM

ATOL = 1e-5
_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    num_hidden_layers=3,
)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=1e4, attention_bias=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=True)),
}


# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request: pytest.FixtureRequest) -> tuple[Any, DecoderLM]:
    config_cls, model_cls, extra = FAMILIES[request.param]
    hf_config = config_cls(**_COMMON, **extra, attn_implementation="eager")
    hf, ours = hf_and_ours(
        hf_config, model_cls, weight_scale=0.3
    )  # large enough that attention is far from uniform
    return hf, ours


def _hf_last_position(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    """(num_layers, seq_len): transformers' attention of the last query, averaged over heads."""
    with torch.no_grad():
        out = hf(ids[None], use_cache=False, output_attentions=True)
    return torch.stack([a[0, :, -1, :].mean(dim=0) for a in out.attentions]).float()


@pytest.mark.parametrize("seq_len", [1, 7, 33])
def test_matches_transformers_eager_attention(models: tuple[Any, DecoderLM], seq_len: int) -> None:
    hf, ours = models
    ids = torch.randint(
        0, _COMMON["vocab_size"], (seq_len,), generator=torch.Generator().manual_seed(seq_len)
    )
    probs = last_position_attention(ours, ids)
    expected = _hf_last_position(hf, ids)
    assert probs.shape == (_COMMON["num_hidden_layers"], seq_len)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[0]), atol=ATOL, rtol=0)
    if seq_len > 1:  # the random weights make attention far from uniform: the check has teeth
        assert (probs.max(dim=-1).values - probs.min(dim=-1).values).max() > 0.05


@pytest.mark.slow
def test_embedded_model_rows_sum_to_one(llm: LLM) -> None:
    """Through the public API on the real model (fast kernels on): shape, rows summing to 1, and
    the same answer for a string, its ids and its render."""
    rendered = llm.render([{"role": "user", "content": "What is the capital of France?"}])
    probs = llm.attention_probs(rendered)
    assert probs.shape == (llm.engine.model_config.num_hidden_layers, len(rendered.token_ids))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[0]), atol=1e-4, rtol=0)
    assert (probs >= 0).all()
    torch.testing.assert_close(llm.attention_probs(rendered.token_ids), probs)
    with pytest.raises(ValueError, match="empty"):
        llm.attention_probs([])
