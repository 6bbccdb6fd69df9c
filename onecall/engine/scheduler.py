"""The scheduler: which sequences run this step, and how many tokens each feeds.

Policy (continuous batching with chunked prefill, like vLLM v1):
  1. Running sequences first, oldest first: each gets the tokens it still needs
     (1 when decoding, a chunk when prefilling), within the step's token budget.
     If its KV blocks cannot be grown, the youngest running sequence is preempted
     (its blocks freed, its computed path left in the prefix cache, itself put back
     at the head of the queue to be recomputed), until it fits or it was itself
     preempted. Preemption never loses a token already sampled.
  2. Then waiting sequences, in arrival order, while the budget, max_num_seqs and
     free blocks allow; a new arrival joins the batch at the very next step. The
     first admission matches the prefix cache; a prompt chunk starts after the hit.
     A request collecting prompt logprobs matches only what it has logprobs for
     (Sequence.prefix_cache_tokens: nothing, when fresh): cached positions have no logits.
     A match whose copies the pool cannot hold is cut back (BlockManager.begin), so the
     head of the queue waits only for blocks that running sequences hold: a request that
     fits the pool alone is admitted once they are done. (One that never fits would hold
     the queue for good: intake refuses those, max_model_len <= the pool's tokens.)
     num_cached_tokens (the sequence's and its trace's) is what was really reused.
  3. No admission happens in a step that preempted (the pool is under pressure).
Abort frees a sequence's blocks at once, whatever its state.

A hybrid model (linear-attention layers with a per-sequence state: model/state_cache.py) also has a
StateSlots: an admitted sequence takes a live state slot, and its prefix-cache hit is cut back to the
longest state snapshot within the KV match (engine/state_slots.py); a prompt fully computed, a
sequence finished or preempted leaves a snapshot of its state. The trace records the KV match and
where the snapshot cut it.

Pure bookkeeping: no tensors here, so it is tested with a real BlockManager and
fake sequences.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from onecall.engine.block_manager import BlockManager, PrefixMatch
from onecall.engine.sequence import FinishReason, Sequence, SequenceStatus
from onecall.engine.state_slots import Resume, StateSlots, aligned_snapshot


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step: token_ids[num_computed : num_computed + n]
    # a hybrid model: (position p, state slot) where the forward writes the state after p tokens,
    # inside this chunk (engine/state_slots.py: the aligned snapshot)
    snapshot: tuple[int, int] | None = None

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence's tokens (so its logits give a token)?
        Never for max_tokens 0: such a request ends with its prompt (a scoring request)."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens and seq.params.max_tokens > 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_slots: StateSlots | None = None,
    ) -> None:
        self.block_manager = block_manager
        # a hybrid model's state slots (one live slot per admitted sequence: max_num_seqs of them)
        self.state_slots = state_slots
        assert state_slots is None or state_slots.num_live >= max_num_seqs
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ---- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence: its computed path goes into the prefix cache, its blocks are freed.
        An aborted or failed one commits nothing (a failed step raised somewhere between writing
        KV and counting it: nothing of that request is trusted)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):  # already gone from the queue
                self.waiting.remove(seq)
        self._release(seq, keep_in_cache=reason not in (FinishReason.ABORT, FinishReason.ERROR))
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def commit_prompt(self, seq: Sequence) -> None:
        """A prompt now fully computed goes into the prefix cache at once, so requests sharing it hit
        while this one still decodes; finish() commits the rest. The scheduler is the one place that
        commits to the prefix cache."""
        self.block_manager.commit(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
        self._snapshot(seq)

    def _snapshot(self, seq: Sequence) -> None:
        """A hybrid model: keep the state after the tokens the sequence has fed (state_slots.py)."""
        if self.state_slots is not None and self.block_manager.enable_prefix_caching:
            computed = seq.token_ids[: seq.num_computed_tokens]
            self.state_slots.snapshot(seq.seq_id, computed, seq.params.cache_salt)

    def _release(self, seq: Sequence, keep_in_cache: bool) -> None:
        if not seq.is_admitted:
            return
        if keep_in_cache and seq.num_computed_tokens > 0:
            self.block_manager.commit(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
            self._snapshot(seq)
        self.block_manager.free(seq.seq_id)
        if self.state_slots is not None:
            self.state_slots.release(seq.seq_id)
        seq.is_admitted = False

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.state_slots is not None:
            self.state_slots.drop_pending()  # reserved for a forward that never ran (it raised)

        # 1. running sequences, oldest first; preempt the youngest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.ensure_capacity(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing younger is left running
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # 2. admit waiting sequences (not in a step that had to preempt)
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, out):
                break
            budget -= out.scheduled[-1].num_new_tokens
        if self.state_slots is not None and self.block_manager.enable_prefix_caching:
            for item in out.scheduled:
                self._reserve_aligned_snapshot(item)
        return out

    def _reserve_aligned_snapshot(self, item: ScheduledSeq) -> None:
        """A prompt chunk that crosses the prompt's aligned snapshot position: the forward also writes
        the state there (engine/state_slots.py, "aligned")."""
        assert self.state_slots is not None
        seq = item.seq
        boundary = aligned_snapshot(seq.num_prompt_tokens)
        if not seq.num_computed_tokens < boundary <= seq.num_computed_tokens + item.num_new_tokens:
            return
        slot = self.state_slots.reserve(seq.token_ids[:boundary], seq.params.cache_salt)
        if slot is not None:
            item.snapshot = (boundary, slot)

    def forward_done(self) -> None:
        """The step's forward ran: the snapshots it wrote can be resumed from."""
        if self.state_slots is not None:
            self.state_slots.confirm_pending()

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        match, start, kv_matched = self._begin(seq)
        n = min(seq.num_tokens - match.num_cached_tokens, budget)
        if not self.block_manager.ensure_capacity(seq.seq_id, match.num_cached_tokens + n):
            self.block_manager.free(seq.seq_id)
            return False
        self.waiting.popleft()
        seq.is_admitted = True
        if self.state_slots is not None:
            self.state_slots.acquire(seq.seq_id)
            self.state_slots.resume(seq.seq_id, start)
            seq.trace.record_state_resume(start.num_tokens, kv_matched)
        seq.num_computed_tokens = match.num_cached_tokens
        d = match.divergence
        divergence = (
            None
            if d is None
            else {"index": d.index, "prompt_token": d.prompt_token, "cached_token": d.cached_token}
        )
        if seq.trace.record_admission(
            match.num_cached_tokens, divergence, match.is_capped, match.num_dropped_tokens
        ):
            seq.num_cached_tokens = match.num_cached_tokens  # the first admission's match is the request's
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n))
        return True

    def _begin(self, seq: Sequence) -> tuple[PrefixMatch, Resume, int]:
        """BlockManager.begin on the sequence's cacheable tokens, the state snapshot it starts from and
        the KV match; for a hybrid model the match is cut back to the longest state snapshot within
        the KV match (its divergence and capping kept)."""
        tokens, salt = seq.prefix_cache_tokens, seq.params.cache_salt
        if self.state_slots is None:
            match = self.block_manager.begin(seq.seq_id, tokens, salt)
            return match, Resume(0, None), match.num_cached_tokens
        full = self.block_manager.peek(tokens, salt)
        start = self.state_slots.best(tokens, full.num_cached_tokens, salt)
        cut = self.block_manager.begin(seq.seq_id, tokens[: start.num_tokens + 1] if start.num_tokens else [], salt)
        if cut.num_cached_tokens != start.num_tokens:  # the pool could not hold the copies: no hit at all
            self.block_manager.free(seq.seq_id)
            cut, start = self.block_manager.begin(seq.seq_id, [], salt), Resume(0, None)
        cut_match = PrefixMatch(start.num_tokens, full.divergence, full.is_capped, full.num_dropped_tokens)
        return cut_match, start, full.num_cached_tokens

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: keep its tokens, drop its KV (the prefix cache may keep it)."""
        self.running.remove(seq)
        self._release(seq, keep_in_cache=True)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.trace.record_preemption()
        self.waiting.appendleft(seq)
