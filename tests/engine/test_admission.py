"""Admission never deadlocks: every prompt that fits the pool alone is eventually admitted.

A cached match is not free: each partly matched or mixed block is copied into a fresh block while its
source blocks stay pinned, so a match can need more blocks than the whole pool has although the prompt
alone fits. begin() then falls back to the longest block-aligned prefix of the match it can afford
(down to no match at all) and the dropped positions are recomputed. These tests drive the real
Scheduler and BlockManager the way the engine does (a fake forward writes KVSim's memory), with
check_invariants() after every step and every sequence reading its own KV.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as SequenceABC

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onecall.engine.block_manager import BlockManager, Divergence, PrefixMatch
from onecall.engine.scheduler import Scheduler
from onecall.engine.sequence import FinishReason, Sequence
from onecall.engine.trace import RequestTrace
from onecall.sampling_params import SamplingParams
from tests.engine.test_block_manager import KVSim


class CountingBlockManager(BlockManager):
    """Counts begin()'s fallbacks, so a random test can show it reached them."""

    num_fallbacks = 0

    def begin(self, seq_id: int, token_ids: SequenceABC[int], salt: str | None = None) -> PrefixMatch:
        match = super().begin(seq_id, token_ids, salt)
        self.num_fallbacks += match.num_dropped_tokens > 0
        return match


class FakeEngine:
    """Engine.step without a model: schedule, run the copies, write each chunk's KV, sample token 0,
    commit a finished prompt, retire a sequence at max_tokens. Checks the books after every step."""

    def __init__(self, num_blocks: int, bs: int, budget: int = 64, max_num_seqs: int = 8) -> None:
        self.kv = CountingBlockManager(num_blocks, bs)
        self.sched = Scheduler(self.kv, max_num_seqs, budget)
        self.sim = KVSim(self.kv)
        self.finished: list[Sequence] = []
        self._next_id = 0

    def add(self, prompt: list[int], max_tokens: int = 1) -> Sequence:
        self._next_id += 1
        i = self._next_id
        seq = Sequence(
            seq_id=i,
            request_id=f"r{i}",
            prompt_token_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens),
            max_total_tokens=10_000,
            trace=RequestTrace(request_id=f"r{i}"),
        )
        self.sched.add(seq)
        return seq

    def step(self) -> None:
        out = self.sched.schedule()
        self.sim.apply_copies()
        for item in out.scheduled:
            seq, n = item.seq, item.num_new_tokens
            seq.trace.record_scheduled(1.0)  # (the engine's stamp: later admissions are not the request's)
            self.sim.assert_reads(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.sim.write(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.num_computed_tokens + n)
            samples = item.samples
            seq.num_computed_tokens += n
            if not samples:
                continue
            if seq.num_output_tokens == 0:
                self.sched.commit_prompt(seq)
            seq.token_ids.append(0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, FinishReason.LENGTH)
                self.finished.append(seq)
        self.kv.check_invariants()
        self.sim.assert_tree_content()

    def run(self, max_steps: int) -> int:
        """Step until every request finished; the number of steps it took (fails past max_steps)."""
        for steps in range(1, max_steps + 1):
            self.step()
            if not self.sched.num_unfinished:
                return steps
        waiting = [(s.request_id, s.num_tokens) for s in self.sched.waiting]
        raise AssertionError(
            f"stuck after {max_steps} steps: waiting {waiting}, free {self.kv.num_free_blocks}"
        )


def test_a_match_the_pool_cannot_copy_falls_back_and_the_queue_moves() -> None:
    """Pool of 2 blocks of 4. The cache holds [1..6] (block 0 full, block 1 half). Prompt [1..5, 7, 8, 9]
    matches 5 tokens: share block 0, copy position 4 out of block 1 into a fresh block while block 1
    stays pinned: 3 blocks. The prompt alone needs 2. It reuses 4 tokens (block 0) and recomputes the
    fifth; the request queued behind it runs once it is done."""
    eng = FakeEngine(num_blocks=2, bs=4)
    eng.add([1, 2, 3, 4, 5, 6])
    eng.run(max_steps=5)
    prompt = [1, 2, 3, 4, 5, 7, 8, 9]
    assert eng.kv.peek(prompt) == PrefixMatch(4, Divergence(5, 7, 6), num_dropped_tokens=1)
    seq, behind = eng.add(prompt), eng.add([50, 51, 52])
    eng.run(max_steps=10)
    assert [s.request_id for s in eng.finished[1:]] == [seq.request_id, behind.request_id]
    assert seq.num_cached_tokens == seq.trace.num_cached_tokens == 4  # what was really reused
    # the divergence stays a fact about the cache: where the prompt left the cached path
    assert seq.trace.divergence == {"index": 5, "prompt_token": 7, "cached_token": 6}


def test_mixed_blocks_pin_about_three_blocks_each() -> None:
    """A chat whose turns grow by 4 tokens from a 6-token start (blocks of 4): each turn copies the
    previous prompt's half block and writes the next half beside it, so every cached block after the
    first is mixed (its positions sit in two physical blocks). The fourth turn's full match of 14
    tokens shares 1 block and copies 3 while pinning 5 more: 9 blocks, in a pool of 7, although its
    18 tokens need 5. It is admitted on the first 8 tokens."""
    eng = FakeEngine(num_blocks=7, bs=4)
    prompt = list(range(100, 106))
    for _ in range(3):
        eng.add(prompt)
        eng.run(max_steps=5)
        prompt = prompt + [len(prompt) + j for j in range(4)]
    slots = eng.kv.tree.match(prompt).slots
    assert [len({s // 4 for s in slots[i : i + 4]}) for i in range(0, 14, 4)] == [1, 2, 2, 1]
    assert eng.kv.num_free_blocks == 1 and eng.kv.num_evictable_blocks == 6
    assert eng.kv.peek(prompt) == PrefixMatch(8, None, num_dropped_tokens=6)
    seq = eng.add(prompt)
    eng.run(max_steps=5)
    assert seq.num_cached_tokens == 8 and seq.is_finished


def test_no_fallback_while_the_copies_fit() -> None:
    eng = FakeEngine(num_blocks=8, bs=4)
    eng.add([1, 2, 3, 4, 5, 6])
    eng.run(max_steps=5)
    seq = eng.add([1, 2, 3, 4, 5, 7, 8, 9])
    eng.run(max_steps=5)
    assert seq.num_cached_tokens == 5
    assert seq.trace.divergence == {"index": 5, "prompt_token": 7, "cached_token": 6}


# ---- random pools and prompts ---------------------------------------------------------------------
def _random_run(rng: random.Random, bs: int, num_blocks: int, budget: int) -> int:
    """Waves of prompts over a 3-token alphabet (so paths share prefixes and blocks get mixed), each
    wave queued at once; every prompt fits the pool alone (prompt + its one sampled token), so every
    wave must finish."""
    eng = FakeEngine(num_blocks, bs, budget=budget, max_num_seqs=rng.randint(1, 4))
    capacity = num_blocks * bs
    paths: list[list[int]] = []
    for _ in range(6):
        wave = []
        for _ in range(rng.randint(1, 4)):
            base = rng.choice(paths) if paths and rng.random() < 0.7 else []
            prompt = base[: rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(1, 6))]
            prompt = prompt[: capacity - 1]
            max_tokens = rng.randint(1, capacity - len(prompt))
            wave.append(eng.add(prompt, max_tokens))
            paths.append(prompt)
        eng.run(max_steps=400)
        assert all(s.is_finished for s in wave)
        for s in wave:
            assert s.num_cached_tokens == s.trace.num_cached_tokens < s.num_prompt_tokens
    return eng.kv.num_fallbacks


@pytest.mark.parametrize("seed", range(40))
def test_seeded_random_pools_admit_every_prompt_that_fits(seed: int) -> None:
    rng = random.Random(seed)
    bs = [1, 2, 4, 8][seed % 4]
    _random_run(rng, bs, rng.randint(2, 8), rng.randint(1, 16))


def test_the_random_runs_reach_the_fallback() -> None:
    fallbacks = 0
    for seed in range(12):
        rng = random.Random(seed)
        fallbacks += _random_run(rng, [1, 2, 4, 8][seed % 4], rng.randint(2, 8), rng.randint(1, 16))
    assert fallbacks >= 10


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    bs=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 6),
    budget=st.integers(1, 12),
)
def test_random_pools_admit_every_prompt_that_fits(seed: int, bs: int, num_blocks: int, budget: int) -> None:
    _random_run(random.Random(seed), bs, num_blocks, budget)
