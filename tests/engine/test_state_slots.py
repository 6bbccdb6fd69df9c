"""A hybrid model's state slots (engine/state_slots.py) alone and under the scheduler: pure bookkeeping."""

from __future__ import annotations

import random

from onecall.engine.block_manager import BlockManager
from onecall.engine.scheduler import Scheduler
from onecall.engine.sequence import FinishReason, Sequence
from onecall.engine.state_slots import Resume, StateSlots
from onecall.engine.trace import RequestTrace
from onecall.sampling_params import SamplingParams


def test_live_slots_are_handed_out_once_and_come_back() -> None:
    s = StateSlots(num_live=3, num_snapshots=2)
    assert s.num_slots == 5
    got = [s.acquire(i) for i in range(3)]
    assert sorted(got) == [0, 1, 2] and s.acquire(1) == got[1]  # acquiring again: the same slot
    s.release(1)
    s.release(1)  # unknown now: no-op
    assert s.acquire(7) == got[1]
    s.check_invariants()


def test_a_snapshot_is_found_only_for_its_own_prefix_within_the_limit() -> None:
    s = StateSlots(num_live=2, num_snapshots=4)
    s.acquire(0)
    assert s.snapshot(0, [5, 6, 7, 8])
    assert s.take_copies() == [(s.slot(0), 2)]  # live -> the first snapshot slot
    assert s.best([5, 6, 7, 8, 9, 10], limit=6) == Resume(4, 2)
    assert s.best([5, 6, 7, 8, 9, 10], limit=3) == Resume(0, None)  # the KV match stops before it
    assert s.best([5, 6, 7, 9, 9, 10], limit=6) == Resume(0, None)  # another prefix of that length
    assert s.best([5, 6, 7, 8, 9], limit=6, salt="tenant-b") == Resume(0, None)  # another salt
    assert not s.snapshot(0, [5, 6, 7, 8])  # kept already: refreshed, no second copy
    assert s.take_copies() == []
    s.acquire(1)
    s.resume(1, s.best([5, 6, 7, 8, 1], limit=4))
    assert s.take_copies() == [(2, s.slot(1))]
    s.check_invariants()


def test_the_longest_usable_snapshot_wins_and_lru_recycles() -> None:
    s = StateSlots(num_live=1, num_snapshots=2)
    s.acquire(0)
    s.snapshot(0, [1, 2])
    s.snapshot(0, [1, 2, 3, 4])
    assert s.best([1, 2, 3, 4, 5], limit=5).num_tokens == 4
    assert s.best([1, 2, 3, 9, 5], limit=5).num_tokens == 2
    s.best([1, 2], limit=2)  # best() alone does not refresh: [1, 2] is still the oldest
    s.snapshot(0, [7, 7, 7])  # full: the least recently used ([1, 2]) goes
    assert s.best([1, 2, 3, 9, 5], limit=5).num_tokens == 0
    assert s.best([7, 7, 7, 1], limit=4).num_tokens == 3
    assert s.num_snapshots_held == 2
    s.check_invariants()


def test_a_copy_into_a_snapshot_dropped_before_the_step_is_not_run() -> None:
    s = StateSlots(num_live=1, num_snapshots=1)
    s.acquire(0)
    s.snapshot(0, [1])
    s.snapshot(0, [2])  # drops [1] (its slot reused for [2]) before any step ran
    assert s.take_copies() == [(0, 1)]  # one copy into slot 1: the live state now, for [2]
    assert s.best([2, 3], limit=1).num_tokens == 1 and s.best([1, 3], limit=1).num_tokens == 0


def test_no_snapshot_room_means_no_snapshots() -> None:
    s = StateSlots(num_live=1, num_snapshots=0)
    s.acquire(0)
    assert not s.snapshot(0, [1, 2, 3]) and s.take_copies() == []
    assert s.best([1, 2, 3, 4], limit=3) == Resume(0, None)


def test_random_operations_keep_every_slot_accounted_for() -> None:
    rng = random.Random(0)
    s = StateSlots(num_live=4, num_snapshots=3)
    live: set[int] = set()
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            i = rng.randrange(100)
            s.acquire(i)
            live.add(i)
        elif op < 0.5 and live:
            i = rng.choice(sorted(live))
            s.release(i)
            live.discard(i)
        elif op < 0.8 and live:
            s.snapshot(rng.choice(sorted(live)), [rng.randrange(3) for _ in range(rng.randrange(1, 5))])
        else:
            tokens = [rng.randrange(3) for _ in range(6)]
            r = s.best(tokens, limit=rng.randrange(7))
            assert r.num_tokens == 0 or r.slot is not None
        copies = s.take_copies()
        assert all(0 <= a < s.num_slots and 0 <= b < s.num_slots for a, b in copies)
        s.check_invariants()


# ---- under the scheduler -------------------------------------------------------------------------
def _seq(i: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(
        seq_id=i,
        request_id=f"r{i}",
        prompt_token_ids=list(tokens),
        params=SamplingParams(cache_salt=salt),
        max_total_tokens=10_000,
        trace=RequestTrace(request_id=f"r{i}"),
    )


def _run_prompt(s: Scheduler, seq: Sequence) -> None:
    """Schedule until the prompt is computed, as the engine does (commit_prompt at its end)."""
    s.add(seq)
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        for item in s.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
    s.commit_prompt(seq)


def test_a_hybrid_hit_resumes_at_the_last_snapshot_and_the_trace_says_where() -> None:
    """Turn 1's prompt leaves a snapshot when computed and another when it finishes (after its fed
    tokens); turn 2 re-sends the transcript: KV matches all of turn 1's fed tokens and the state resumes
    there. A third request sharing only part of the system prompt matches KV but finds no snapshot
    inside its match: it starts from scratch, and its trace says the KV match was longer."""
    slots = StateSlots(num_live=4, num_snapshots=8)
    s = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, state_slots=slots)
    system = list(range(100, 120))
    turn1 = _seq(1, [*system, 1, 2, 3])
    _run_prompt(s, turn1)
    assert slots.num_snapshots_held == 1  # after the prompt (23 tokens)
    turn1.token_ids += [50, 51]  # generated: 50 was fed back, 51 sampled last and never fed
    turn1.num_computed_tokens += 1
    s.finish(turn1, FinishReason.STOP)
    assert slots.num_snapshots_held == 2  # after the 24 fed tokens
    copies = slots.take_copies()
    assert len(copies) == 2 and all(dst >= 4 for _, dst in copies)  # live -> snapshot slots

    turn2 = _seq(2, [*system, 1, 2, 3, 50, 51, 7, 8])
    s.add(turn2)
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(turn2, 27 - 24)]
    assert turn2.num_computed_tokens == 24 and turn2.trace.num_cached_tokens == 24
    assert turn2.trace.state_resumed_at == 24 and turn2.trace.num_kv_matched_tokens == 24
    ((src, dst),) = slots.take_copies()
    assert src >= 4 and dst == slots.slot(2)  # the snapshot into turn 2's live slot

    other = _seq(3, [*system[:10], 99, 98])
    s.add(other)
    s.schedule()
    assert other.num_computed_tokens == 0 and other.trace.num_cached_tokens == 0
    assert other.trace.num_kv_matched_tokens == 10 and other.trace.state_resumed_at == 0
    assert slots.take_copies() == []
    slots.check_invariants()


def test_preemption_and_abort_give_back_the_live_slot() -> None:
    slots = StateSlots(num_live=2, num_snapshots=2)
    s = Scheduler(BlockManager(5, 4), max_num_seqs=2, max_num_batched_tokens=64, state_slots=slots)
    a, b = _seq(1, list(range(8))), _seq(2, list(range(20, 28)))
    s.add(a)
    s.add(b)
    out = s.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.token_ids.append(5)
    assert {slots.slot(1), slots.slot(2)} == {0, 1}
    out = s.schedule()  # both need a third block, the pool (5) has room for one more: b is preempted
    assert out.preempted == [b]
    slots.check_invariants()
    assert slots.acquire(9) in (0, 1)  # b's slot is free again
    slots.release(9)
    s.finish(a, FinishReason.ABORT)  # an abort leaves no snapshot of its state
    held = slots.num_snapshots_held
    assert held == 1  # only b's, taken at its preemption (after its 8 fed tokens)
    slots.check_invariants()
