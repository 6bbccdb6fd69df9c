"""KV cache bookkeeping: which physical blocks each sequence uses, which are shared, what to copy.

Pure Python, no tensors. The K/V themselves live in the model's PagedKVCache, where slot
s = block * block_size + offset; this module hands out block ids and slot ids, and queues
(src_slot, dst_slot) copies that the model runner applies before the next forward. Within one
drain no slot is written twice (targets are fresh blocks; a copy into a block that was freed and
handed out again is dropped) and no slot is read after an earlier op wrote it (targets enter the
tree only on commit, after the forward), so applying them in order and applying them as one
batched gather-then-scatter (cache[dst] = cache[src]) give the same result.

Who holds a block (refcount[b] is the number of holders, free iff 0):

    | holder                | counted                                  | released by                 |
    |-----------------------|------------------------------------------|-----------------------------|
    | a sequence            | once per sequence whose table has b      | free(seq_id)                |
    | the radix tree        | once while tree_tokens[b] > 0            | eviction / reset            |

    free list      == {b : refcount[b] == 0}
    evictable      == {b : refcount[b] == 1 and tree_tokens[b] > 0}   (held by the tree only)
    used           == everything else (some sequence holds it)

Prefix reuse at token granularity (begin): the prompt's longest cached path gives one slot
per matched position (at most len(prompt) - 1 of them, so the model still computes a token).
Logical block i of the match is then either

    | case                                                | action                          |
    |-----------------------------------------------------|---------------------------------|
    | all block_size positions matched, all in ONE block  | share it (refcount + 1)          |
    | partly matched (the last one), or "mixed" (its      | allocate a fresh block and copy |
    | positions sit in different physical blocks)         | the matched slots into it        |

A copy needs a fresh block while its sources stay pinned (their tree nodes may not be evicted before
the copy runs), so an L-block match can need about 3L blocks (mixed blocks: a target and two pinned
sources each) although the prompt alone needs L. When the free blocks plus what eviction can free
beside the pinned nodes cannot hold the copies, begin() falls back to the longest block-aligned
prefix of the match that they can (down to no match: it copies nothing), and the dropped positions
are recomputed (PrefixMatch.num_dropped_tokens). So begin() never refuses, and a prompt that fits
the pool alone is admitted once the running sequences have left it room.

A sequence never writes into a shared block: shared blocks are full and lie entirely below
num_cached_tokens, and every block it writes to is one it allocated itself. Running
sequences hold their blocks directly, so evicting tree entries never frees memory in use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from onecall.engine.radix_cache import RadixCache, TreeNode
from onecall.errors import InvalidParameterError


@dataclass(frozen=True)
class Divergence:
    """Where a prompt leaves the longest cached path."""

    index: int  # token position where the prompt and the cache first differ
    prompt_token: int
    cached_token: int  # from the branch the path would have continued on (the MRU one)


@dataclass(frozen=True)
class PrefixMatch:
    """What a prompt reuses from the prefix cache."""

    num_cached_tokens: int  # tokens whose KV is reused (shared blocks + copied slots)
    divergence: Divergence | None  # None when the cached path simply ended (or no cache)
    is_capped: bool = False  # the whole prompt was cached; reuse stopped at len(prompt) - 1
    # matched but recomputed: the pool could not hold their copies (begin's fallback). The prompt ran
    # num_cached_tokens + num_dropped_tokens + is_capped tokens along the cached path.
    num_dropped_tokens: int = 0


@dataclass(frozen=True)
class _Plan:
    """How begin() sets a match up (peek() reports its `match`)."""

    match: PrefixMatch
    slots: list[int]  # (match.num_cached_tokens,) the cached slot of each reused position
    blocks: list[int | None]  # per logical block of the reused positions: the block to share, or None (copy)
    pinned: list[TreeNode]  # the path's nodes those positions lie in: not evicted to make room for copies
    path: list[TreeNode]  # every node the match went through (all are touched: the prompt used them)


class BlockPool:
    """Free list and holder counts of the physical blocks (see the table above)."""

    def __init__(self, num_blocks: int) -> None:
        self.refcount = [0] * num_blocks  # holders: sequences + (1 if tree_tokens > 0)
        self.tree_tokens = [0] * num_blocks  # tree positions whose slot lies in the block
        # Free blocks: a stack (low ids come out first) with lazy deletion: allocate(prefer=b) takes b
        # out of the middle by clearing is_free[b] only, so the stack may hold stale entries, which
        # pop skips. Every free block has at least one entry; compaction bounds the stale ones.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks
        self._num_free = num_blocks
        self._num_evictable = 0  # running count of blocks held by the tree only

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    def free_blocks(self) -> list[int]:
        """The free blocks the stack can hand out (each once)."""
        return list(dict.fromkeys(b for b in self._free if self._is_free[b]))

    def allocate(self, prefer: int | None = None) -> int:
        """A free block: `prefer` if it is free (keeps a sequence's blocks consecutive), else the top
        of the stack. The caller checked num_free > 0."""
        if prefer is not None and 0 <= prefer < len(self._is_free) and self._is_free[prefer]:
            block = prefer
        else:
            block = self._free.pop()
            while not self._is_free[block]:  # a stale entry (taken by prefer)
                block = self._free.pop()
        assert self.refcount[block] == 0 and self.tree_tokens[block] == 0
        self._is_free[block] = False
        self._num_free -= 1
        self.refcount[block] = 1
        return block

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of these already-held blocks (the hot path of begin)."""
        refcount, tree_tokens = self.refcount, self.tree_tokens
        for block in blocks:
            assert refcount[block] > 0, "sharing a free block"
            if refcount[block] == 1 and tree_tokens[block] > 0:
                self._num_evictable -= 1  # two holders now: no longer the tree's alone
            refcount[block] += 1

    def decref(self, block: int) -> None:
        self._change(block, -1, 0)

    def add_tree_tokens(self, block: int, count: int) -> None:
        self._change(block, 1 if self.tree_tokens[block] == 0 else 0, count)

    def remove_tree_tokens(self, block: int, count: int) -> None:
        self._change(block, -1 if self.tree_tokens[block] == count else 0, -count)

    def is_evictable(self, block: int) -> bool:
        return self.refcount[block] == 1 and self.tree_tokens[block] > 0

    def _change(self, block: int, d_ref: int, d_tree: int) -> None:
        was_evictable = self.is_evictable(block)
        self.refcount[block] += d_ref
        self.tree_tokens[block] += d_tree
        assert self.refcount[block] >= 0 and self.tree_tokens[block] >= 0
        self._num_evictable += self.is_evictable(block) - was_evictable
        if d_ref < 0 and self.refcount[block] == 0:
            self._free.append(block)
            self._is_free[block] = True
            self._num_free += 1
            if len(self._free) > 2 * len(self._is_free):  # drop stale and repeated entries, keep LIFO order
                live = dict.fromkeys(b for b in reversed(self._free) if self._is_free[b])
                self._free = list(reversed(live))


class BlockManager:
    """Block tables per sequence plus the radix prefix cache over the same blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise InvalidParameterError("num_blocks", f"must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise InvalidParameterError("block_size", f"must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(self.pool, block_size)
        self._tables: dict[int, list[int]] = {}  # seq_id -> block ids, logical order
        self._runs: dict[int, int] = {}  # seq_id -> leading blocks known to be consecutive ids
        self._salts: dict[int, str] = {}  # seq_id -> its cache_salt, for sequences begun with one
        self._copy_ops: list[tuple[int, int]] = []  # pending (src_slot, dst_slot), in order

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (not counting cache that could be evicted)."""
        return self.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks held only by the prefix cache: free for the taking after eviction."""
        return self.pool.num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.pool.num_free - self.pool.num_evictable

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences; cache-only blocks count as available."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.num_free + self.pool.num_evictable >= num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables[seq_id])

    def block_table_view(self, seq_id: int) -> Sequence[int]:
        """The live table, not a copy (O(1)): for readers within one step that do not keep it."""
        return self._tables[seq_id]

    def first_run_length(self, seq_id: int) -> int:
        """How many leading blocks of the sequence's table are consecutive ids (its KV is then one
        contiguous range of slots). Kept up to date as the table grows: O(new blocks), not O(table)."""
        table, run = self._tables[seq_id], self._runs[seq_id]
        if run == len(table) or run == 0:  # the run may have grown with the table
            run = max(run, 1 if table else 0)
            while run < len(table) and table[run] == table[run - 1] + 1:
                run += 1
            self._runs[seq_id] = run
        return run

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slot ids of positions [start, end) of the sequence."""
        table, bs = self._tables[seq_id], self.block_size
        assert 0 <= start <= end <= len(table) * bs, (start, end, len(table) * bs)
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Drain the pending (src_slot, dst_slot) copies (see the module docstring)."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    # ---- prefix matching ----------------------------------------------------------------------
    def peek(self, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        """What begin() would reuse right now (read-only)."""
        return self._plan(list(token_ids), salt).match

    def _plan(self, tokens: list[int], salt: str | None) -> _Plan:
        """The longest cached path (at most len(tokens) - 1 of it), cut back to what the pool can copy."""
        if not self.enable_prefix_caching or not tokens:
            return _Plan(PrefixMatch(0, None), [], [], [], [])
        path = self.tree.match(tokens, salt)
        n = min(path.num_matched, len(tokens) - 1)
        divergence = None
        if path.next_cached_token is not None:
            i = path.num_matched
            divergence = Divergence(i, tokens[i], path.next_cached_token)
        blocks = self._share_or_copy(path.slots[:n])
        num_blocks, num_nodes = self._affordable(blocks, path.nodes, n)
        kept = min(num_blocks * self.block_size, n)
        match = PrefixMatch(kept, divergence, path.num_matched == len(tokens), n - kept)
        return _Plan(match, path.slots[:kept], blocks[:num_blocks], path.nodes[:num_nodes], path.nodes)

    def _share_or_copy(self, slots: list[int]) -> list[int | None]:
        """For each logical block of these positions' slots: the block to share, if they fill it whole
        and in order, else None (copy them into a fresh block). See the module docstring."""
        bs = self.block_size
        if bs == 1:  # every block is whole
            return list(slots)
        plan: list[int | None] = []
        for start in range(0, len(slots), bs):
            seg = slots[start : start + bs]
            full_and_whole = len(seg) == bs and seg == list(range(seg[0], seg[0] + bs))
            plan.append(seg[0] // bs if full_and_whole else None)
        return plan

    def _affordable(self, blocks: list[int | None], nodes: list[TreeNode], n: int) -> tuple[int, int]:
        """How many leading logical blocks of the plan begin() can set up now, and how many leading path
        nodes their positions lie in. All of them when their copies fit in the free blocks plus what
        eviction frees beside those nodes (which stay: they hold the sources, and a shared block leaves
        the evictable ones); else the longest prefix that fits (no block at all always does)."""
        pool, bs = self.pool, self.block_size
        if blocks.count(None) <= pool.num_free:  # no eviction needed
            return len(blocks), _num_nodes_before(nodes, n)
        room = pool.num_free + pool.num_evictable
        pinned: set[int] = set()  # evictable blocks of the nodes [0, i), which cover positions [0, end)
        copies = i = end = 0
        for k, shared in enumerate(blocks):
            while end < min((k + 1) * bs, n):
                pinned.update(b for b in {s // bs for s in nodes[i].slots} if pool.is_evictable(b))
                end += len(nodes[i].key)
                i += 1
            copies += shared is None
            if copies > room - len(pinned):
                return k, _num_nodes_before(nodes, k * bs)
        return len(blocks), i

    def begin(self, seq_id: int, token_ids: Sequence[int], salt: str | None = None) -> PrefixMatch:
        """Start a sequence on its cached prefix (under its cache_salt: paths cached with another salt,
        or none, never match): shared blocks and queued copies, so its table covers the reused
        positions. The match is cut back when the pool cannot hold its copies (module docstring), so
        this never fails; the sequence's own blocks come from ensure_capacity."""
        assert seq_id not in self._tables, f"sequence {seq_id} already started"
        plan = self._plan(list(token_ids), salt)
        bs, n, num_copies = self.block_size, plan.match.num_cached_tokens, plan.blocks.count(None)

        # 1. make room without evicting the nodes the match reads (their slots are the copy sources)
        if num_copies > self.pool.num_free:
            self.tree.evict(num_copies, protected=plan.pinned)
            assert self.pool.num_free >= num_copies

        # 2. build the block table: share whole blocks, copy the rest slot by slot
        table = [b for b in plan.blocks if b is not None]
        self.pool.share(table)
        if num_copies:
            table = []
            for i, shared in enumerate(plan.blocks):
                block = self._allocate(after=table[-1] if table else None) if shared is None else shared
                table.append(block)
                if shared is None:
                    for p in range(i * bs, min((i + 1) * bs, n)):
                        self._copy_ops.append((plan.slots[p], block * bs + p % bs))
        self._tables[seq_id] = table
        self._runs[seq_id] = 0
        if salt is not None:
            self._salts[seq_id] = salt  # what commit() inserts under
        self.tree.touch(plan.path)  # (a dropped node that step 1 evicted is gone: touching it is moot)
        return plan.match

    # ---- growth, commit, release --------------------------------------------------------------
    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the sequence's table to hold num_tokens positions, evicting cache if needed.
        False (and no change) if even that is not enough: the scheduler must preempt."""
        table = self._tables[seq_id]
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        self.tree.evict(need)
        for _ in range(need):  # prefer the block right after the last: the KV stays one run of slots
            table.append(self._allocate(after=table[-1] if table else None))
        return True

    def _allocate(self, after: int | None = None) -> int:
        block = self.pool.allocate(prefer=None if after is None else after + 1)
        if self._copy_ops:  # copies still queued into this block's previous life are dead
            bs = self.block_size
            self._copy_ops = [op for op in self._copy_ops if op[1] // bs != block]
        return block

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """KV of token_ids (the sequence's tokens so far) is written: cache that path. Positions
        the tree already has keep the tree's slots (e.g. a copied block's matched part)."""
        if not self.enable_prefix_caching:
            return
        tokens = list(token_ids)
        table = self._tables[seq_id]
        assert len(tokens) <= len(table) * self.block_size, "committing tokens without KV slots"

        def slots_of(start: int, end: int) -> list[int]:
            new = self.slots(seq_id, start, end)
            if self._copy_ops:  # the drain guarantee above: a queued copy target is not yet KV
                assert not set(new) & {dst for _, dst in self._copy_ops}, "commit before copies ran"
            return new

        self.tree.insert(tokens, slots_of, self._salts.get(seq_id))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references (finish, abort, preemption). Unknown ids: no-op."""
        self._runs.pop(seq_id, None)
        self._salts.pop(seq_id, None)
        # last block first: the free stack's top is then the table's first block, so the next sequence
        # (allocate's `prefer` walks consecutive blocks) reuses these blocks in order, pages already
        # touched and maybe still cached, rather than walking on into never-touched ones
        for block in reversed(self._tables.pop(seq_id, ())):
            self.pool.decref(block)

    def reset_prefix_cache(self) -> None:
        """Drop the whole tree; blocks held by sequences stay theirs."""
        self.tree.reset()

    # ---- checking -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute every count from scratch and compare (for tests; O(blocks + tree))."""
        pool = self.pool
        # 1. the tree: shape, slot offsets, each slot referenced once, tokens per block
        tree_tokens = self.tree.check_and_count(self.num_blocks)
        assert tree_tokens == pool.tree_tokens, "tree-token counts drifted"
        # 2. holders: sequences (each block at most once per table) + the tree
        holders = [int(c > 0) for c in tree_tokens]
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice"
            for block in table:
                holders[block] += 1
        assert holders == pool.refcount, "refcounts != recomputed holders"
        # 3. free list and the evictable count
        free = pool.free_blocks()
        assert len(free) == pool.num_free, "free count drifted from the free stack"
        assert set(free) == {b for b, r in enumerate(holders) if r == 0}, "free list != unheld blocks"
        assert pool.num_evictable == sum(pool.is_evictable(b) for b in range(self.num_blocks))


def _num_nodes_before(nodes: list[TreeNode], n: int) -> int:
    """How many leading nodes of a root path start before position n (the ones positions [0, n) use)."""
    count = start = 0
    while count < len(nodes) and start < n:
        start += len(nodes[count].key)
        count += 1
    return count
