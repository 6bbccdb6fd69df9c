"""Tests for onecall.sampling: the batched sampler against independent references.

References are computed here with plain torch on one row at a time (softmax,
sorting, hand-written penalty arithmetic). Statistical checks use fixed seeds,
so they are deterministic; each tolerance is written next to its check, sized
at about 5 standard deviations of the empirical frequency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from onecall.sampling.bitmask import pack_bitmask
from onecall.sampling.sampler import sample
from onecall.sampling.types import SamplingRequest, TokenConstraint
from onecall.sampling_params import SamplingParams


def req(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
    constraint: TokenConstraint | None = None,
    **params: Any,
) -> SamplingRequest:
    """A request; a seed in params gets its own CPU generator, as the engine does."""
    p = SamplingParams(**params)
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return SamplingRequest(p, list(prompt), list(output), gen, constraint, list(banned))


def frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


def draw_many(logits_row: torch.Tensor, n: int, **params: Any) -> list[int]:
    """n draws from one row, as one batch of n identical unseeded rows (fast, shared draw)."""
    torch.manual_seed(1234)
    p = SamplingParams(**params)
    rows = [SamplingRequest(p, [], [], None) for _ in range(n)]
    return sample(logits_row.expand(n, -1).contiguous(), rows).token_ids


class AllowSet:
    """A TokenConstraint allowing a fixed set of ids (optionally a mask shorter than the vocab)."""

    def __init__(self, allowed: Sequence[int], mask_len: int) -> None:
        mask = torch.zeros(1, mask_len, dtype=torch.bool)
        mask[0, list(allowed)] = True
        self.words = pack_bitmask(mask)[0]
        self.advanced: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row] = 0
        bitmask[row, : self.words.numel()] = self.words
        return True

    def advance(self, token_id: int) -> None:
        self.advanced.append(token_id)

    def is_finished(self) -> bool:
        return False


VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


# ---------------------------------------------------------------- greedy and its limits


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [req(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6 and out.num_masked == [0] * 6
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows() -> None:
    # Row 0,2 greedy; rows 1,3 sample a flat distribution and must not always hit the argmax.
    g = torch.Generator().manual_seed(1)
    seen_random: set[int] = set()
    for _ in range(50):
        logits = torch.randn(4, 50, generator=g) * 0.1
        out = sample(logits, [req(temperature=0.0), req(), req(temperature=0.0), req(temperature=2.0)])
        assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(logits[2].argmax())
        seen_random.update(out.token_ids[i] for i in (1, 3))
    assert len(seen_random) > 20  # 100 draws from ~uniform over 50 ids


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"min_p": 0.999}])
def test_degenerate_truncation_equals_greedy(params: dict[str, Any]) -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [req(temperature=1.5, **params) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- seeds


def run_seeded(
    target: dict[str, Any], scale: float, others: list[dict[str, Any]], position: int, steps: int = 20
) -> list[int]:
    """The seeded `target` row's tokens over `steps` steps, placed at `position` among `others`."""
    g = torch.Generator().manual_seed(99)  # other rows' logits
    batch = [req(**o) for o in others]
    batch.insert(position, req(**target))
    tokens: list[int] = []
    for step in range(steps):
        logits = torch.randn(len(batch), 1000, generator=g)
        logits[position] = torch.randn(1000, generator=torch.Generator().manual_seed(step)) * scale
        tokens.append(sample(logits, batch).token_ids[position])
    return tokens


@pytest.mark.parametrize(
    ("target", "scale"),
    [
        ({"temperature": 0.9, "top_p": 0.95, "top_k": 40}, 1.0),
        ({"top_p": 0.8}, 4.0),  # peaked: the nucleus closes inside the first candidates
        ({"top_p": 0.8}, 1.0),  # flat: a nucleus of hundreds of tokens, decided by the full sort
        ({"temperature": 1.2, "min_p": 0.05, "repetition_penalty": 1.3}, 1.0),
    ],
)
def test_seed_is_batch_independent(target: dict[str, Any], scale: float) -> None:
    alone = run_seeded({"seed": 7, **target}, scale, [], 0)
    mixed: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"seed": 8},
        {"top_p": 0.5},
        {"top_k": 500},  # widens the candidate set
        {"top_k": 3, "min_p": 0.1},
        {"presence_penalty": 1.0, "repetition_penalty": 0.8},
        {},
    ]
    assert run_seeded({"seed": 7, **target}, scale, mixed, 2) == alone
    assert run_seeded({"seed": 7, **target}, scale, mixed[::-1], 7) == alone
    assert run_seeded({"seed": 8, **target}, scale, [], 0) != alone


# ---------------------------------------------------------------- distributions


def test_temperature_frequencies_match_softmax() -> None:
    n, t = 40_000, 0.7
    freq = frequencies(draw_many(LOGITS, n, temperature=t), VOCAB)
    expected = torch.softmax(LOGITS.double() / t, -1)
    # max std of a frequency is sqrt(0.25 / 40000) = 0.0025; 5 sigma = 0.0125
    assert (freq - expected).abs().max() < 0.0125


def test_seeded_stream_frequencies_match_softmax() -> None:
    # The per-request generator path, one row over many steps.
    r = req(seed=3, temperature=1.3)
    tokens = [sample(LOGITS[None], [r]).token_ids[0] for _ in range(4000)]
    expected = torch.softmax(LOGITS.double() / 1.3, -1)
    # 5 sigma at n=4000: 5 * sqrt(0.25 / 4000) = 0.04
    assert (frequencies(tokens, VOCAB) - expected).abs().max() < 0.04


def test_top_k_renormalizes_over_the_k_best() -> None:
    freq = frequencies(draw_many(LOGITS, 40_000, top_k=3), VOCAB)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[:3] = torch.softmax(LOGITS[:3].double(), -1)  # LOGITS is sorted descending
    assert freq[3:].sum() == 0
    assert (freq - expected).abs().max() < 0.0125


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.softmax(LOGITS.double(), -1)
    cum = probs.cumsum(0)
    top_p = float(cum[2] + 0.01)  # needs the 4 best tokens (ids 0..3)
    freq = frequencies(draw_many(LOGITS, 40_000, top_p=top_p), VOCAB)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[:4] = probs[:4] / probs[:4].sum()
    assert freq[4:].sum() == 0
    assert (freq - expected).abs().max() < 0.0125


def test_top_k_then_top_p_renormalizes_after_k() -> None:
    # vLLM order: top-p is measured on the top-k renormalized distribution.
    probs = torch.softmax(LOGITS.double(), -1)
    probs_k = torch.softmax(LOGITS[:4].double(), -1)  # after top_k=4
    top_p = 0.70
    assert probs_k[0] < top_p <= probs_k[:2].sum()  # renormalized: the nucleus is ids {0, 1}
    assert probs[:2].sum() < top_p  # without renormalizing it would be {0, 1, 2}
    freq = frequencies(draw_many(LOGITS, 20_000, top_k=4, top_p=top_p), VOCAB)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[:2] = probs[:2] / probs[:2].sum()
    assert freq[2:].sum() == 0
    # 5 sigma at n=20000: 5 * sqrt(0.25 / 20000) = 0.018
    assert (freq - expected).abs().max() < 0.018


@pytest.mark.parametrize(("vocab", "slope"), [(2000, 1.0), (10_000, 8.0)])
def test_top_p_nucleus_larger_than_candidates(vocab: int, slope: float) -> None:
    # Smooth descending rows whose 0.9 nucleus (~1800 and ~2900 tokens) lies far
    # past the first 256 candidates: decided by the full sort, resp. the second
    # candidate round.
    logits = torch.linspace(slope, 0.0, vocab)  # descending: token id == rank
    probs = torch.softmax(logits.double(), -1)
    cutoff = int((probs.cumsum(0) < 0.9).sum()) + 1  # reference nucleus size
    n, window = 1000, 300
    tail_mass = float(probs[cutoff - window : cutoff].sum() / probs[:cutoff].sum())
    assert (1 - tail_mass) ** n < 1e-9  # so the window below is hit unless the nucleus is cut short
    tokens = draw_many(logits, n, top_p=0.9)
    assert max(tokens) < cutoff
    assert max(tokens) >= cutoff - window


def test_min_p_threshold() -> None:
    probs = torch.softmax(LOGITS.double(), -1)
    min_p = 0.3  # keeps tokens with p >= 0.3 * p_max: ids 0, 1, 2 (ratios 1, 0.61, 0.37)
    kept = probs >= min_p * probs.max()
    assert kept.tolist() == [True] * 3 + [False] * 5
    freq = frequencies(draw_many(LOGITS, 40_000, min_p=min_p), VOCAB)
    expected = torch.where(kept, probs, 0.0)
    expected /= expected.sum()
    assert (freq - expected).abs().max() < 0.0125


# ---------------------------------------------------------------- processing and logprobs


def test_penalties_against_hand_computed_reference() -> None:
    logits = torch.tensor([[1.2, -2.0, 3.0, 0.4, -1.0, 2.0]])
    prompt, output = [0, 1], [1, 2, 2]
    out = sample(
        logits,
        [
            req(
                prompt,
                output,
                temperature=0.0,
                logprobs=6,
                repetition_penalty=2.0,
                presence_penalty=0.5,
                frequency_penalty=0.25,
            )
        ],
    )
    # repetition over prompt+output {0, 1, 2}: 1.2/2, -2.0*2, 3.0/2
    # then output counts {1: 1, 2: 2}: id 1 -= 0.25*1 + 0.5, id 2 -= 0.25*2 + 0.5
    expected = torch.tensor([0.6, -4.0 - 0.75, 1.5 - 1.0, 0.4, -1.0, 2.0])
    ref = torch.log_softmax(expected, -1)
    assert out.token_ids == [5]  # penalized id 2 (3.0 -> 0.5) loses to id 5
    top = out.top_logprobs[0]
    assert top is not None and [t for t, _ in top] == ref.argsort(descending=True).tolist()
    for t, v in top:
        assert v == pytest.approx(float(ref[t]), abs=1e-6)


def test_logit_bias_and_bans() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    out = sample(logits, [req(temperature=0.0, logit_bias={7: 10.0}), req(temperature=0.0, banned=[3, 4])])
    assert out.token_ids[0] == 7 and out.token_ids[1] != 3
    assert out.num_masked == [0, 2]


def test_constraint_mask_restricts_samples() -> None:
    vocab = 64
    allowed = [5, 17, 40, 41]
    c = AllowSet(allowed, mask_len=50)  # shorter than the vocab: the tail counts as disallowed
    g = torch.Generator().manual_seed(4)
    for step in range(100):
        logits = torch.randn(2, vocab, generator=g)
        logits[0, 60] = 50.0  # the unconstrained favourite lies outside the mask
        out = sample(logits, [req(constraint=c, temperature=2.0), req(constraint=c, seed=step)])
        assert set(out.token_ids) <= set(allowed)
        assert out.num_masked == [vocab - len(allowed)] * 2
    assert c.advanced == []  # the engine advances constraints, not the sampler


def test_grammar_wins_over_bans_and_empty_rows_fail_alone() -> None:
    # a constraint that allows only a banned id (a grammar that may only end, under min_tokens): it wins
    c = AllowSet([2], mask_len=8)
    out = sample(torch.zeros(1, 8), [req(constraint=c, banned=[2])])
    assert out.token_ids == [2] and out.num_masked == [7] and out.num_allowed == [1] and out.failed == {}
    # rows left with nothing (a grammar allowing nothing; bans covering the row) and a grammar that
    # raises are reported in `failed`, each naming its cause; the other rows sample as if alone
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 8, generator=g)
    rows = [
        req(constraint=AllowSet([], mask_len=8)),
        req(temperature=0.0, logprobs=2),
        req(banned=range(8), min_tokens=3, max_tokens=5, logprobs=1),
        req(constraint=Raises()),
        req(temperature=0.7, seed=11),
    ]
    out = sample(logits.clone(), rows)
    assert sorted(out.failed) == [0, 2, 3]
    assert (out.failed[0].stage, out.failed[0].param) == ("sampler", "structured_outputs")
    assert (out.failed[2].stage, out.failed[2].param) == ("sampler", "min_tokens")
    assert "min_tokens (3)" in str(out.failed[2])
    assert (out.failed[3].stage, out.failed[3].param) == ("grammar", "structured_outputs")
    assert isinstance(out.failed[3].cause, RuntimeError)
    fresh = {1: req(temperature=0.0, logprobs=2), 4: req(temperature=0.7, seed=11)}  # generators not yet drawn from
    alone = [sample(logits[i : i + 1].clone(), [fresh[i]]) for i in (1, 4)]
    assert [out.token_ids[1], out.token_ids[4]] == [a.token_ids[0] for a in alone]
    assert out.top_logprobs[1] == alone[0].top_logprobs[0]
    assert out.logprobs[2] is not None and math.isfinite(out.logprobs[2])  # a failed row stays finite


class Raises:
    """A TokenConstraint whose fill raises (a grammar failing mid-request)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        raise RuntimeError("matcher broke")

    def advance(self, token_id: int) -> None: ...

    def is_finished(self) -> bool:
        return False


def test_logprobs_of_processed_logits() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 30, generator=g)
    c = AllowSet([1, 2, 3], mask_len=30)
    rows = [
        req(temperature=0.5, top_k=5, logprobs=4, logit_bias={0: 3.0}),
        req(logprobs=5, constraint=c),  # only 3 allowed: 3 alternatives
        req(logprobs=0),
    ]
    out = sample(logits, rows)
    processed = logits.clone()
    processed[0, 0] += 3.0  # temperature and top-k are not part of logprobs
    processed[1, [i for i in range(30) if i not in (1, 2, 3)]] = -math.inf
    ref = torch.log_softmax(processed, -1)
    for i, n in enumerate((4, 3, 0)):
        lp, top = out.logprobs[i], out.top_logprobs[i]
        assert lp == pytest.approx(float(ref[i, out.token_ids[i]]), abs=1e-6)
        assert top is not None and len(top) == n
        assert [t for t, _ in top] == ref[i].argsort(descending=True)[:n].tolist()
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))
    assert {t for t, _ in out.top_logprobs[1] or []} == {1, 2, 3}
