"""DecoderLM over the paged KV cache against transformers, float32 on CPU.

Tiny random-weight Llama, Qwen2 and Qwen3 models are built with transformers
(eager attention), their state_dict is loaded into our DecoderLM, and every
logit we produce (prefill, decode, prefix-cache hit, chunked prefill, mixed
batches) is compared with transformers' full forward over the same tokens.
Tolerance: max abs diff <= 1e-4 on logits of magnitude up to ~5. Block size 4 and
scrambled physical block ids make every block boundary and indirection count.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from onecall.loading.weights import load_weights
from onecall.model.attention_metadata import build_attention_metadata
from onecall.model.decoder import DecoderLM
from onecall.model.kv_cache import PagedKVCache
from tests.helpers.make_models import hf_and_ours

ATOL = 1e-4  # max abs diff between our logits and transformers'
BLOCK_SIZE = 4
NUM_BLOCKS = 64
VOCAB = 512

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1e4),
    ),
    "llama_bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1e4, attention_bias=True),
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(num_hidden_layers=3, tie_word_embeddings=False, rope_theta=1e6),
    ),
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1e6, head_dim=32),
    ),
}


# tiny matmuls: one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass
class Models:
    hf: Any
    ours: DecoderLM


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request: pytest.FixtureRequest) -> Models:
    config_cls, model_cls, extra = FAMILIES[request.param]
    hf_config = config_cls(**_COMMON, **extra, attn_implementation="eager")
    hf, ours = hf_and_ours(hf_config, model_cls, weight_scale=0.15)
    return Models(hf, ours)


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab) logits of transformers' full forward, no cache."""
    with torch.no_grad():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


@dataclass
class Seq:
    tokens: list[int]
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)


class Harness:
    """A stand-in for the engine's block bookkeeping: a pool of scrambled physical blocks."""

    def __init__(self, model: DecoderLM, seed: int = 1, dtype: torch.dtype = torch.float32) -> None:
        c = model.config
        self.model = model
        self.kv_cache = PagedKVCache(
            c.num_hidden_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            c.num_key_value_heads,
            c.head_dim,
            dtype,
            "cpu",
        )
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()

    def reserve(self, seq: Seq, length: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < length:
            seq.block_table.append(self.free.pop())

    def step(
        self, batch: list[tuple[Seq, int]], backend: str = "paged", num_decode: int | None = None
    ) -> list[torch.Tensor]:
        """Run `num_new` uncached tokens of each sequence in one flat forward; per-sequence logits.
        `num_decode`: the leading rows planned as decode rows (AttentionMetadata.num_decode)."""
        ids: list[int] = []
        positions: list[int] = []
        for seq, num_new in batch:
            end = seq.num_cached + num_new
            self.reserve(seq, end)
            ids += seq.tokens[seq.num_cached : end]
            positions += range(seq.num_cached, end)
        meta = build_attention_metadata(
            [s.block_table for s, _ in batch],
            [s.num_cached + n for s, n in batch],
            [n for _, n in batch],
            BLOCK_SIZE,
            "cpu",
            backend=backend,
            num_decode=num_decode,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
        for seq, num_new in batch:
            seq.num_cached += num_new
        return list(logits.split([n for _, n in batch]))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs diff {diff:.2e} > {ATOL}"


def test_prefill_matches_transformers(models: Models) -> None:
    seq = Seq(prompt(20, seed=10))
    (logits,) = Harness(models.ours).step([(seq, 20)])
    assert_close(logits, hf_logits(models.hf, seq.tokens))


def test_greedy_decode_through_paged_cache(models: Models) -> None:
    harness = Harness(models.ours)
    seq = Seq(prompt(7, seed=11))
    (logits,) = harness.step([(seq, 7)])
    steps = []
    for _ in range(22):  # crosses several block boundaries
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = harness.step([(seq, 1)])
        steps.append(logits[-1])
    # transformers is causal: row t of one full forward is its logits for the sequence up to t.
    ref = hf_logits(models.hf, seq.tokens)
    for i, step_logits in enumerate(steps):
        assert_close(step_logits, ref[7 + i])


def test_prefix_cache_hit_with_copy_on_write(models: Models) -> None:
    harness = Harness(models.ours)
    a = Seq(prompt(18, seed=12))
    harness.step([(a, 18)])
    # B shares A's first 10 tokens: blocks 0-1 fully (positions 0-7), block 2 partly (positions 8-9).
    shared = 10
    b = Seq(a.tokens[:shared] + prompt(9, seed=13), num_cached=shared)
    full = shared // BLOCK_SIZE
    b.block_table = a.block_table[:full]
    harness.reserve(b, len(b.tokens))
    offsets = range(full * BLOCK_SIZE, shared)
    harness.kv_cache.copy_slots(
        [a.block_table[full] * BLOCK_SIZE + p % BLOCK_SIZE for p in offsets],
        [b.block_table[full] * BLOCK_SIZE + p % BLOCK_SIZE for p in offsets],
    )
    (logits,) = harness.step([(b, len(b.tokens) - shared)])
    assert_close(logits, hf_logits(models.hf, b.tokens)[shared:])
    # A is untouched by B's writes: its next decode step still matches.
    a.tokens.append(int(prompt(1, seed=14)[0]))
    (logits,) = harness.step([(a, 1)])
    assert_close(logits[-1], hf_logits(models.hf, a.tokens)[-1])


def test_chunked_prefill(models: Models) -> None:
    harness = Harness(models.ours)
    seq = Seq(prompt(23, seed=15))
    ref = hf_logits(models.hf, seq.tokens)
    while seq.num_cached < len(seq.tokens):
        start = seq.num_cached
        num_new = min(5, len(seq.tokens) - start)  # chunks of 5 straddle blocks of 4
        (logits,) = harness.step([(seq, num_new)])
        assert_close(logits, ref[start : start + num_new])


def test_mixed_batch_matches_each_sequence_alone(models: Models) -> None:
    harness = Harness(models.ours)
    d = Seq(prompt(11, seed=16))
    harness.step([(d, 11)])
    d.tokens.append(7)
    p1, p2 = Seq(prompt(9, seed=17)), Seq(prompt(14, seed=18))
    refs = [
        hf_logits(models.hf, p1.tokens),
        hf_logits(models.hf, d.tokens)[-1:],
        hf_logits(models.hf, p2.tokens),
    ]
    for backend in ("paged", "reference"):
        for s in (p1, p2, d):  # rerun the same step on both paths (rewrites identical K/V)
            s.num_cached = 0 if s is not d else 11
        out = harness.step([(p1, 9), (d, 1), (p2, 14)], backend=backend)
        for ours, ref in zip(out, refs, strict=True):
            assert_close(ours, ref)


def test_paged_decode_equals_reference_loop(models: Models) -> None:
    harness = Harness(models.ours)
    seqs = [Seq(prompt(n, seed=20 + n)) for n in (3, 9, 6, 13)]  # different lengths: padding mask in use
    harness.step([(s, len(s.tokens)) for s in seqs])
    for s in seqs:
        s.tokens.append(int(prompt(1, seed=40 + len(s.tokens))[0]))
    fast = harness.step([(s, 1) for s in seqs], backend="paged")
    for s in seqs:
        s.num_cached -= 1
    loop = harness.step([(s, 1) for s in seqs], backend="reference")
    for f, ref_loop, s in zip(fast, loop, seqs, strict=True):
        assert (f - ref_loop).abs().max().item() <= 1e-5
        assert_close(f[-1], hf_logits(models.hf, s.tokens)[-1])


def test_bfloat16_tracks_float32(models: Models) -> None:
    """dtype plumbing (weights, RoPE tables, cache, norms) in bfloat16.

    bf16 cannot match float32 to 1e-4, so the tolerance is calibrated on transformers itself: our bf16
    error against float32 must stay within twice transformers' own bf16 error on the same tokens.
    """
    tokens = prompt(12, seed=30)
    ref = hf_logits(models.hf, tokens + [3])  # float32 reference
    hf_err = (hf_logits(copy.deepcopy(models.hf).to(torch.bfloat16), tokens + [3]) - ref).abs().max().item()
    tol = max(2 * hf_err, 0.05)
    ours16 = DecoderLM(models.ours.config, dtype=torch.bfloat16)
    load_weights(ours16, models.hf.state_dict().items())
    harness = Harness(ours16, dtype=torch.bfloat16)
    seq = Seq(list(tokens))
    (prefill,) = harness.step([(seq, 12)])
    assert prefill.dtype == torch.float32 and harness.kv_cache.k.dtype == torch.bfloat16
    seq.tokens.append(3)
    (decode,) = harness.step([(seq, 1)])
    err = (torch.cat([prefill, decode]) - ref).abs().max().item()
    assert err <= tol, f"bf16 max abs diff {err:.3f} > {tol:.3f} (transformers' own bf16 error {hf_err:.3f})"
