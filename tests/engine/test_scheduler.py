"""Scheduler policy alone: pure bookkeeping with a real BlockManager and bare sequences."""

from __future__ import annotations

from onecall.engine.block_manager import BlockManager
from onecall.engine.scheduler import Scheduler
from onecall.engine.sequence import FinishReason, Sequence, SequenceStatus
from onecall.engine.trace import RequestTrace
from onecall.sampling_params import SamplingParams


def make_seq(i: int, n_prompt: int) -> Sequence:
    return Sequence(
        seq_id=i,
        request_id=f"r{i}",
        prompt_token_ids=[1000 * i + j for j in range(n_prompt)],
        params=SamplingParams(),
        max_total_tokens=10_000,
        trace=RequestTrace(request_id=f"r{i}"),
    )


def advance(sched_out) -> None:  # type: ignore[no-untyped-def]
    """What the engine does after the model ran: count computed tokens, append a sampled token."""
    for item in sched_out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(7)


def test_budget_chunks_prefill_and_decode_goes_first() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(1, 3), make_seq(2, 25)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("r1", 3), ("r2", 7)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    advance(out)
    out = s.schedule()  # a decodes (1 token), b continues its prefill with the rest of the budget
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("r1", 1), ("r2", 9)]


def test_max_num_seqs_limits_admission() -> None:
    s = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(i, 4) for i in range(4)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert [x.seq for x in out.scheduled] == seqs[:2]
    assert len(s.waiting) == 2
    s.finish(seqs[0], FinishReason.STOP)
    advance(out)
    out = s.schedule()
    assert seqs[2] in [x.seq for x in out.scheduled]


def test_preempts_youngest_and_readmits_it_first() -> None:
    kv = BlockManager(6, 4, enable_prefix_caching=False)  # 24 slots
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old, young = make_seq(1, 11), make_seq(2, 11)  # 3 blocks each: the pool is full after admission
    s.add(old)
    s.add(young)
    advance(s.schedule())
    for _ in range(2):  # old needs a 4th block at 13 tokens -> the youngest is preempted
        out = s.schedule()
        advance(out)
    assert young.status is SequenceStatus.WAITING and young.num_computed_tokens == 0
    assert young.trace.num_preemptions == 1
    assert s.waiting[0] is young and s.running == [old]
    assert len(young.token_ids) == 13  # its two sampled tokens survive the preemption
    s.finish(old, FinishReason.STOP)
    out = s.schedule()
    assert [x.seq for x in out.scheduled] == [young]
    assert out.scheduled[0].num_new_tokens == 13 and out.scheduled[0].samples


def test_abort_of_waiting_and_running_frees_everything() -> None:
    kv = BlockManager(10, 4)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = make_seq(1, 9), make_seq(2, 9)
    s.add(a)
    s.add(b)
    advance(s.schedule())
    s.finish(b, FinishReason.ABORT)  # waiting
    s.finish(a, FinishReason.ABORT)  # running
    assert s.num_unfinished == 0
    assert kv.num_free_blocks == 10


def test_prefix_cache_reuse_stops_where_prompt_logprobs_are_missing() -> None:
    """Cached positions have no logits: a request collecting prompt logprobs reuses none of its
    prompt when fresh, and after a preemption only the positions whose entries it already has
    (k entries collected: at most k - 1 positions); with every entry collected, all of it."""
    kv = BlockManager(100, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    warm = make_seq(1, 20)
    s.add(warm)
    advance(s.schedule())
    s.finish(warm, FinishReason.STOP)  # its 20 prompt tokens (and the sampled one) are cached
    seq = Sequence(
        seq_id=2,
        request_id="r2",
        prompt_token_ids=list(warm.prompt_token_ids),
        params=SamplingParams(max_tokens=0, prompt_logprobs=0),
        max_total_tokens=10_000,
        trace=RequestTrace(request_id="r2"),
    )
    assert seq.prompt_logprobs == [None] and seq.prefix_cache_tokens == []
    s.add(seq)
    out = s.schedule()
    assert seq.num_cached_tokens == 0 and out.scheduled[0].num_new_tokens == 20
    assert not out.scheduled[0].samples  # max_tokens 0: the prompt's end samples nothing
    seq.prompt_logprobs += [-1.0] * 9  # as if preempted with tokens 0..9 collected
    assert seq.prefix_cache_tokens == seq.token_ids[:10]  # begin() reuses at most 9 of them
    assert kv.peek(seq.prefix_cache_tokens).num_cached_tokens == 9
    seq.prompt_logprobs += [-1.0] * 10  # all 20: nothing left to collect, any reuse is fine
    assert not seq.needs_prompt_logprobs and seq.prefix_cache_tokens == seq.token_ids
