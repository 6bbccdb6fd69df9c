"""Token-granularity radix tree over cached KV slots, with LRU leaf eviction.

Each edge holds a run of token ids (`key`) and, position by position, the KV slot that
holds that token's K/V (`slots`, slot = block * block_size + offset). A root-to-node path
spells a token prefix; the slots along it are KV computed for exactly that prefix, so any
prompt that starts with the same tokens can reuse them (SGLang's radix cache, not vLLM's
hash per full block, so nothing is lost at a block boundary).

The tree knows nothing about sequences. It tells the block pool (`TreeBlockRefs`) how
many of its tokens live in each block; the pool turns "at least one tree token" into one
reference on the block. Invariants kept here (checked by BlockManager.check_invariants):

    | what                         | invariant                                                |
    |------------------------------|----------------------------------------------------------|
    | node.key, node.slots         | same length, >= 1 (root: both empty)                     |
    | parent.children              | keyed by child.key[0]; siblings start with distinct ids   |
    | slot of path position p      | slot % block_size == p % block_size (offset = position)  |
    | a slot                       | referenced by at most one tree position                  |
    | pool.tree_tokens[b]          | number of tree positions whose slot is in block b        |
    | slots along a path           | hold K/V computed for exactly that path's tokens         |

`cache_salt`: each salt has its own root (no salt: the default root), so a path is only ever matched
by requests with the salt it was inserted under; one tenant's prompts cannot hit (or time) another's.
The salted roots share the pool, the leaf set and LRU eviction with the default one; a salted root
is dropped once its last path is evicted.

Splitting an edge after k tokens moves key/slots[:k] into a new parent node: no slot changes
hands, so the per-block counts stay as they are. Eviction removes whole leaves, least recently used
first, preferring leaves whose removal frees at least one block.

`listener` (None by default, and then nothing below computes anything for it) hears each change of
the set of cached token paths, on the thread that changes the tree: positions [start, len(path)) of
`path` became cached (insert) or stopped being cached (a leaf evicted), or everything went (reset).
Splits change no path and say nothing. server/kv_events.py turns these into vLLM's KV-cache events.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol


class TreeBlockRefs(Protocol):
    """What the tree needs from the block pool (BlockManager's BlockPool)."""

    refcount: list[int]
    tree_tokens: list[int]

    @property
    def num_free(self) -> int: ...
    @property
    def num_evictable(self) -> int: ...
    def add_tree_tokens(self, block: int, count: int) -> None: ...
    def remove_tree_tokens(self, block: int, count: int) -> None: ...


class CacheListener(Protocol):
    """Told about cached paths as they change (RadixCache.listener). `path` is the whole token path
    from the root, a fresh list the listener may keep; `salt` is the path's cache_salt (None: none)."""

    def stored(self, path: list[int], start: int, salt: str | None) -> None: ...
    def removed(self, path: list[int], start: int, salt: str | None) -> None: ...
    def cleared(self) -> None: ...


class TreeNode:
    """One edge of the tree plus the node it leads to."""

    __slots__ = ("key", "slots", "children", "parent", "last_access")

    def __init__(self, key: list[int], slots: list[int], parent: TreeNode | None, last_access: int) -> None:
        self.key = key  # token ids on the edge from parent to this node
        self.slots = slots  # KV slot of each of those tokens
        self.children: dict[int, TreeNode] = {}  # first token of the child's key -> child
        self.parent = parent
        self.last_access = last_access  # logical clock of the last match/insert through here


@dataclass
class PathMatch:
    """The longest cached path that is a prefix of some token list."""

    num_matched: int  # tokens matched (may run into the middle of the last node's edge)
    slots: list[int]  # (num_matched,) slot of each matched position
    nodes: list[TreeNode]  # nodes whose edges the match went through, root excluded
    next_cached_token: int | None  # cached token where the match stopped, None if the path ended


def _common_prefix_len(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of key and tokens[start:]."""
    limit = min(len(key), len(tokens) - start)
    if tokens[start : start + limit] == key[:limit]:  # C-speed fast path
        return limit
    for i in range(limit):
        if key[i] != tokens[start + i]:
            return i
    return limit


class RadixCache:
    """Prefix tree of token ids -> KV slots, reporting its block usage to a pool."""

    def __init__(self, pool: TreeBlockRefs, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = TreeNode([], [], None, 0)  # paths inserted without a salt
        self._salted: dict[str, TreeNode] = {}  # cache_salt -> its own root
        self._salt_of: dict[TreeNode, str] = {}  # the reverse, to drop a salted root once empty
        self._clock = 0
        # Every non-root node without children, kept as the tree changes, so eviction starts from
        # the leaves instead of walking the whole tree (invariant checked by check_and_count).
        self._leaves: set[TreeNode] = set()
        self.listener: CacheListener | None = None

    # ---- lookups ------------------------------------------------------------------------------
    def _root(self, salt: str | None, create: bool = False) -> TreeNode | None:
        if salt is None:
            return self.root
        root = self._salted.get(salt)
        if root is None and create:
            root = self._salted[salt] = TreeNode([], [], None, 0)
            self._salt_of[root] = salt
        return root

    def match(self, tokens: list[int], salt: str | None = None) -> PathMatch:
        """Walk the salt's tree along tokens, comparing whole edges at a time. Read-only."""
        root = self._root(salt)
        if root is None:
            return PathMatch(0, [], [], None)
        node, pos, n = root, 0, len(tokens)
        slots: list[int] = []
        nodes: list[TreeNode] = []
        next_cached: int | None = None
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:  # the prompt leaves the tree at a node: report the MRU branch
                if node.children:
                    next_cached = max(node.children.values(), key=lambda c: c.last_access).key[0]
                break
            nodes.append(child)
            k = _common_prefix_len(child.key, tokens, pos)
            slots.extend(child.slots if k == len(child.key) else child.slots[:k])
            pos += k
            if k < len(child.key):  # stopped inside the edge
                if pos < n:
                    next_cached = child.key[k]
                break
            node = child
        return PathMatch(pos, slots, nodes, next_cached)

    def roots(self) -> list[TreeNode]:
        """The default root, then one per cache_salt that has a cached path."""
        return [self.root, *self._salted.values()]

    def touch(self, nodes: list[TreeNode]) -> None:
        """Mark nodes as just used (for LRU)."""
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock

    def iter_nodes(self) -> Iterator[tuple[TreeNode, int]]:
        """Every non-root node, under every salt, with the position its edge starts at (depth-first)."""
        stack = [(child, 0) for root in self.roots() for child in root.children.values()]
        while stack:
            node, start = stack.pop()
            yield node, start
            stack.extend((child, start + len(node.key)) for child in node.children.values())

    # ---- insertion ----------------------------------------------------------------------------
    def insert(
        self, tokens: list[int], slots_of: Callable[[int, int], list[int]], salt: str | None = None
    ) -> None:
        """Make tokens a cached path under the salt. Positions already in the tree keep the tree's
        slots; the new suffix [m, len) takes slots_of(m, len) (the inserting sequence's slots)."""
        if not tokens:
            return  # (and no empty salted root is made)
        self._clock += 1
        node = self._root(salt, create=True)
        assert node is not None
        pos, n = 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common_prefix_len(child.key, tokens, pos)
            if k < len(child.key):
                if pos + k == n:  # tokens end inside this edge: nothing new to add
                    child.last_access = self._clock
                    return
                child = self._split(child, k)
            child.last_access = self._clock
            node, pos = child, pos + k
        if pos == n:
            return
        leaf = TreeNode(tokens[pos:], slots_of(pos, n), node, self._clock)
        node.children[tokens[pos]] = leaf
        self._leaves.discard(node)
        self._leaves.add(leaf)
        for block, count in self._block_counts(leaf.slots).items():
            self.pool.add_tree_tokens(block, count)
        if self.listener is not None:
            self.listener.stored(list(tokens), pos, salt)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut node's edge after k tokens; return the new upper half (node becomes its child).
        Slots only move between the halves, so per-block tree-token counts are unchanged."""
        assert node.parent is not None and 0 < k < len(node.key)
        upper = TreeNode(node.key[:k], node.slots[:k], node.parent, node.last_access)
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[k:], node.slots[k:], upper
        upper.children[node.key[0]] = node
        return upper

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, target_free: int, protected: Collection[TreeNode] = ()) -> None:
        """Remove LRU leaves until pool.num_free >= target_free or no unprotected leaf is left.

        Heap key: (_rank, last_access). A rank-1 entry is re-checked when popped and pushed
        back as rank 0 if evicting its neighbours made it freeing.
        """
        if self.pool.num_free >= target_free:
            return
        protected = set(protected)
        heap: list[tuple[int, int, int, TreeNode]] = []
        tie = 0
        for node in self._leaves:
            if node not in protected:
                heap.append((self._rank(node), node.last_access, tie, node))
                tie += 1
        heapq.heapify(heap)
        while heap and self.pool.num_free < target_free:
            rank, last_access, _, node = heapq.heappop(heap)
            if rank == 1 and self._rank(node) == 0:
                heapq.heappush(heap, (0, last_access, tie, node))
                tie += 1
                continue
            parent = node.parent
            self._remove_leaf(node)
            assert parent is not None
            if parent.parent is not None and not parent.children and parent not in protected:
                heapq.heappush(heap, (self._rank(parent), parent.last_access, tie, parent))  # now a leaf
                tie += 1

    def reset(self) -> None:
        """Drop every node (sequences keep their own references to the blocks)."""
        for node, _ in list(self.iter_nodes()):
            for block, count in self._block_counts(node.slots).items():
                self.pool.remove_tree_tokens(block, count)
        self.root.children.clear()
        self._salted.clear()
        self._salt_of.clear()
        self._leaves.clear()
        if self.listener is not None:
            self.listener.cleared()

    def check_and_count(self, num_blocks: int) -> list[int]:
        """Assert the docstring table (all rows but content) and return tree tokens per block."""
        bs, tree_tokens, seen = self.block_size, [0] * num_blocks, set()
        assert self._leaves == {node for node, _ in self.iter_nodes() if not node.children}, (
            "leaf set drifted"
        )
        assert all(root.children for root in self._salted.values()), "an empty salted root was kept"
        assert self._salt_of == {root: salt for salt, root in self._salted.items()}
        for node, start in self.iter_nodes():
            assert node.key and len(node.key) == len(node.slots)
            assert node.parent is not None and node.parent.children[node.key[0]] is node
            for p, slot in enumerate(node.slots, start):
                assert slot % bs == p % bs, "tree slot offset != position offset"
                assert slot not in seen, "slot referenced twice by the tree"
                seen.add(slot)
                tree_tokens[slot // bs] += 1
        return tree_tokens

    def _rank(self, leaf: TreeNode) -> int:
        """0 if removing the leaf frees its last block, else 1. Looking at the last block only
        keeps this O(block_size) (a leaf's own blocks are its tail); it orders eviction and
        never decides safety. It can only drop from 1 to 0 while evicting: counts only fall."""
        slots, bs = leaf.slots, self.block_size
        block = slots[-1] // bs
        run = 1  # leaf tokens in that block: the trailing run of slots that lie in it
        while run < len(slots) and run < bs and slots[-1 - run] // bs == block:
            run += 1
        return 0 if self.pool.refcount[block] == 1 and self.pool.tree_tokens[block] == run else 1

    def _remove_leaf(self, leaf: TreeNode) -> None:
        assert not leaf.children and leaf.parent is not None
        if self.listener is not None:  # the path and its salt, read before the leaf is detached
            path, start, salt = self._path_of(leaf)
            self.listener.removed(path, start, salt)
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        self._leaves.discard(leaf)
        if parent.parent is not None and not parent.children:  # an inner node became a leaf
            self._leaves.add(parent)
        elif not parent.children and parent in self._salt_of:  # a salted root lost its last path
            del self._salted[self._salt_of.pop(parent)]
        for block, count in self._block_counts(leaf.slots).items():
            self.pool.remove_tree_tokens(block, count)
        leaf.parent = None

    def _path_of(self, node: TreeNode) -> tuple[list[int], int, str | None]:
        """(the token path from the root through node's edge, where node's edge starts, its salt)."""
        keys: list[list[int]] = []
        walk: TreeNode | None = node
        while walk is not None and walk.parent is not None:
            keys.append(walk.key)
            walk = walk.parent
        path = [t for key in reversed(keys) for t in key]
        return path, len(path) - len(node.key), None if walk is None else self._salt_of.get(walk)

    def _block_counts(self, slots: list[int]) -> Counter[int]:
        bs = self.block_size
        return Counter(s // bs for s in slots)
