"""StateSlots: which slot of a hybrid model's state cache holds what (pure Python, no tensors).

A hybrid model (Qwen3.5: Gated DeltaNet layers beside full-attention ones) carries per sequence a
fixed-size state (model/state_cache.py) besides its KV blocks. The state after token p says
everything its linear layers know about tokens 0..p-1, so a cached prefix is usable only up to a
position where that state was kept: a snapshot. This class owns the slots:

    live slots       one per admitted sequence (max_num_seqs of them: admission never waits for one)
    snapshot slots   the state after a known prefix: (salt, tokens[:p]) -> a slot, LRU

Snapshots are taken where a following request is likely to resume (the choice, and why, is in
docs/design.md, "Prefix caching for a hybrid model"):

    prompt end      a prompt fully computed (a request with the same system prompt or document
                    resumes there)
    aligned         the last multiple of SNAPSHOT_ALIGN tokens at least SNAPSHOT_MARGIN tokens before a
                    prompt's end (`aligned_snapshot`), written by the model in the middle of the chunk
                    that crosses it (`reserve`, confirmed once the forward ran): a template that
                    rewrites the end of the previous prompt (Qwen3's drops the empty think block it
                    wrote there) diverges a few tokens before the prompt end, past every other
                    snapshot; a rewrite of at most SNAPSHOT_MARGIN tokens always leaves this one usable
    finish          a request finished or preempted: the next turn of a chat re-sends the whole
                    transcript and resumes after the last token the model was fed

A request resumes at the longest snapshot within its KV match (`best`); the KV match beyond it is
recomputed, and the trace says why the hit was shorter than the token match.

Copies are queued, not run: a step applies them (ModelRunner.run, before the forward) in the order
they were queued, so a snapshot taken of a finished sequence's slot is copied out before a sequence
admitted into that slot in the next step copies a snapshot in, or runs.

Snapshots never hold KV: their positions' KV lives in the radix cache, which may evict it; a
snapshot past the KV match is simply not usable (best() never returns it) until LRU reuses its slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# an aligned snapshot on a multiple of this many prompt tokens (one per prompt: its last such position
# at least SNAPSHOT_MARGIN tokens before its end), so a hit that diverges in the prompt's last
# SNAPSHOT_MARGIN tokens recomputes fewer than SNAPSHOT_ALIGN + SNAPSHOT_MARGIN of them
SNAPSHOT_ALIGN = 64
SNAPSHOT_MARGIN = 16  # Qwen3's rewritten think block is 4 to 9 tokens, by tokenizer
_MOD = (1 << 61) - 1  # a Mersenne prime: prefix hashes stay small ints
_BASE = 1_000_003


def aligned_snapshot(num_prompt_tokens: int) -> int:
    """Where a prompt of this length gets its aligned snapshot (0: none): the last multiple of
    SNAPSHOT_ALIGN at least SNAPSHOT_MARGIN tokens before its end."""
    return max(num_prompt_tokens - 1 - SNAPSHOT_MARGIN, 0) // SNAPSHOT_ALIGN * SNAPSHOT_ALIGN


@dataclass
class Snapshot:
    slot: int
    tokens: tuple[int, ...]  # the prefix whose state the slot holds (checked on a hit: hashes collide)
    salt: str | None


@dataclass(frozen=True)
class Resume:
    """Where an admitted sequence starts: the snapshot used (or none) and its length."""

    num_tokens: int  # the state after this many tokens (0: from scratch)
    slot: int | None  # the snapshot's slot, copied into the sequence's live slot


class StateSlots:
    """Live slots for running sequences and an LRU of prefix snapshots over one state cache."""

    def __init__(self, num_live: int, num_snapshots: int) -> None:
        assert num_live > 0 and num_snapshots >= 0
        self.num_live = num_live
        self.num_snapshots = num_snapshots
        self._free_live = list(range(num_live - 1, -1, -1))  # slots 0..num_live-1, lowest first
        self._live: dict[int, int] = {}  # seq_id -> slot
        self._free_snap = list(range(num_live + num_snapshots - 1, num_live - 1, -1))
        self._snaps: OrderedDict[tuple[str | None, int, int], Snapshot] = OrderedDict()  # LRU, oldest first
        self._lengths: dict[int, int] = {}  # snapshot length -> how many snapshots have it
        self._copies: list[tuple[int, int]] = []
        self._pending: list[tuple[tuple[str | None, int, int], Snapshot]] = []  # reserved, not yet written

    @property
    def num_slots(self) -> int:
        """Slots the state cache must have: live ones first, then the snapshots'."""
        return self.num_live + self.num_snapshots

    # ---- live slots ------------------------------------------------------------------------------
    def acquire(self, seq_id: int) -> int:
        """The sequence's live slot (a new one at its admission)."""
        slot = self._live.get(seq_id)
        if slot is None:
            assert self._free_live, "more admitted sequences than live state slots"
            slot = self._live[seq_id] = self._free_live.pop()
        return slot

    def slot(self, seq_id: int) -> int:
        return self._live[seq_id]

    def release(self, seq_id: int) -> None:
        """The sequence left (finished, aborted, preempted): its slot is free. Unknown ids: no-op."""
        slot = self._live.pop(seq_id, None)
        if slot is not None:
            self._free_live.append(slot)

    # ---- snapshots -------------------------------------------------------------------------------
    def snapshot(self, seq_id: int, tokens: Sequence[int], salt: str | None = None) -> bool:
        """Keep the state the sequence's live slot holds now, the state after `tokens` (its tokens fed
        so far). False if there is no snapshot room or the prefix is kept already (then refreshed)."""
        if self.num_snapshots == 0 or not tokens:
            return False
        key = (salt, len(tokens), _hash(tokens))
        known = self._snaps.get(key)
        if known is not None and known.tokens == tuple(tokens):
            self._snaps.move_to_end(key)
            return False
        if known is not None:  # a hash collision: the newer prefix takes the key
            self._drop(key)
        if not self._free_snap:
            self._drop(next(iter(self._snaps)))  # least recently used
        slot = self._free_snap.pop()
        self._snaps[key] = Snapshot(slot, tuple(tokens), salt)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self._copies.append((self._live[seq_id], slot))
        return True

    def reserve(self, tokens: Sequence[int], salt: str | None = None) -> int | None:
        """A slot for a snapshot the model writes during the next forward (the state after `tokens`,
        in the middle of a prompt chunk): invisible to best() until confirm_pending(). None when there
        is no snapshot room or the prefix is kept already."""
        if self.num_snapshots == 0 or not tokens:
            return None
        key = (salt, len(tokens), _hash(tokens))
        known = self._snaps.get(key)
        if known is not None and known.tokens == tuple(tokens):
            self._snaps.move_to_end(key)
            return None
        if any(k == key for k, _ in self._pending):
            return None
        if known is not None:
            self._drop(key)
        if not self._free_snap:
            if not self._snaps:
                return None  # every snapshot slot is reserved in this step already
            self._drop(next(iter(self._snaps)))
        snap = Snapshot(self._free_snap.pop(), tuple(tokens), salt)
        self._pending.append((key, snap))
        return snap.slot

    def confirm_pending(self) -> None:
        """The forward that wrote the reserved snapshots ran: they can be resumed from."""
        for key, snap in self._pending:
            self._snaps[key] = snap
            n = len(snap.tokens)
            self._lengths[n] = self._lengths.get(n, 0) + 1
        self._pending = []

    def drop_pending(self) -> None:
        """The forward never ran (it raised): the reserved slots are free again, unread."""
        self._free_snap += [snap.slot for _, snap in self._pending]
        self._pending = []

    def best(self, tokens: Sequence[int], limit: int, salt: str | None = None) -> Resume:
        """The longest snapshot of a prefix of `tokens` no longer than `limit` (the KV match), under
        `salt`. Read-only: resume() takes it."""
        lengths = sorted((n for n in self._lengths if n <= limit), reverse=True)
        if not lengths:
            return Resume(0, None)
        hashes = _prefix_hashes(tokens, lengths[0])
        for n in lengths:
            snap = self._snaps.get((salt, n, hashes[n]))
            if snap is not None and snap.tokens == tuple(tokens[:n]):
                return Resume(n, snap.slot)
        return Resume(0, None)

    def resume(self, seq_id: int, start: Resume) -> None:
        """Start the sequence (its live slot acquired) from `start`'s snapshot: queue the copy in and
        mark the snapshot used."""
        if start.slot is None:
            return
        for key, snap in self._snaps.items():
            if snap.slot == start.slot:
                self._snaps.move_to_end(key)
                break
        self._copies.append((start.slot, self._live[seq_id]))

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) slot copies queued since the last call, in order; the step applies them."""
        out, self._copies = self._copies, []
        return out

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset); live slots stay their sequences'."""
        for key in list(self._snaps):
            self._drop(key)

    def _drop(self, key: tuple[str | None, int, int]) -> None:
        snap = self._snaps.pop(key)
        n = len(snap.tokens)
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self._free_snap.append(snap.slot)
        # a queued copy into the dropped slot is dead (the slot may be reused at once)
        self._copies = [c for c in self._copies if c[1] != snap.slot]

    def check_invariants(self) -> None:
        """Every slot is free, live or a snapshot's, exactly once."""
        live = list(self._live.values())
        snaps = [s.slot for s in self._snaps.values()]
        assert sorted(live + self._free_live) == list(range(self.num_live))
        pending = [snap.slot for _, snap in self._pending]
        assert sorted(snaps + pending + self._free_snap) == list(range(self.num_live, self.num_slots))
        assert sum(self._lengths.values()) == len(self._snaps)

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snaps)


def _hash(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
    return h


def _prefix_hashes(tokens: Sequence[int], upto: int) -> list[int]:
    """hashes[n] = _hash(tokens[:n]) for n in 0..upto, in one pass."""
    out = [0] * (upto + 1)
    h = 0
    for i in range(upto):
        h = (h * _BASE + tokens[i] + 1) % _MOD
        out[i + 1] = h
    return out
