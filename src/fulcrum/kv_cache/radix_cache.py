"""Block-granular radix tree mapping token prefixes to cached KV blocks (RadixAttention).

Each node holds a run of whole blocks: ``key`` is their tokens (a multiple of ``block_size``),
``value`` the block ids. Children are keyed by the tokens of their first block, so two children
never share a first block. Every ``extra_key`` (tenant ``cache_salt``, adapter id) has its own
root: no prefix is ever shared across namespaces::

    root[salt=None] ── [sys prompt: b0 b1 b2] ─┬─ [question A: b3]
                                               └─ [question B: b7 b8]

A running request *locks* the deepest node of its cached prefix: ``lock_ref`` is incremented on
that node and every ancestor. Only unlocked leaves are evicted, least recently used first; the
set of unlocked leaves is kept up to date, so eviction costs the leaves it weighs, not the tree.
``evictable_size``/``protected_size`` (in blocks) are kept as counters, checked by
``check_integrity()``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

from fulcrum.kv_cache.block_pool import BlockPool


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), value: list[int] | None = None, parent=None):
        self.key = key
        self.value: list[int] = value or []
        self.parent: TreeNode | None = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.bs = block_size
        self.roots: dict[Hashable, TreeNode] = {}
        self._root_keys: dict[int, Hashable] = {}  # id(root) -> its extra_key
        # called with each node ``evict`` is about to drop, still in the tree (a lower tier
        # may keep a copy of its blocks)
        self.on_evict: Callable[[TreeNode], None] | None = None
        self.evictable_size = 0
        self.protected_size = 0
        self._clock = itertools.count(1)
        self._leaves: set[TreeNode] = set()  # unlocked nodes without children: evictable first

    # -- lookup -------------------------------------------------------------------------------

    def _root(self, extra_key: Hashable) -> TreeNode:
        if extra_key not in self.roots:
            root = TreeNode()
            root.lock_ref = 1  # roots are never evicted
            self.roots[extra_key] = root
            self._root_keys[id(root)] = extra_key
        return self.roots[extra_key]

    def _first(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.bs])

    def match_prefix(
        self, tokens: Sequence[int], extra_key: Hashable = None
    ) -> tuple[list[int], TreeNode]:
        """Longest cached whole-block prefix of ``tokens``: its blocks and its deepest node."""
        node, blocks, i, now = self._root(extra_key), [], 0, next(self._clock)
        n = len(tokens) // self.bs * self.bs
        while i < n:
            child = node.children.get(self._first(tokens, i))
            if child is None:
                break
            m = self._match_len(child.key, tokens, i, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            blocks.extend(child.value)
            node, i = child, i + m
        return blocks, node

    def _match_len(self, key: tuple[int, ...], tokens: Sequence[int], i: int, n: int) -> int:
        """Tokens of ``key`` matched by ``tokens[i:n]``, in whole blocks (≥ 1 block here)."""
        m = self.bs
        while m < len(key) and i + m + self.bs <= n:
            if tuple(tokens[i + m : i + m + self.bs]) != key[m : m + self.bs]:
                break
            m += self.bs
        return m

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after ``m`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:m], child.value[: m // self.bs], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        parent.children[child.key[: self.bs]] = upper
        child.key, child.value, child.parent = child.key[m:], child.value[m // self.bs :], upper
        upper.children[child.key[: self.bs]] = child
        return upper

    # -- insert -------------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        extra_key: Hashable = None,
        start: tuple[TreeNode, int] | None = None,
    ) -> TreeNode:
        """Cache ``blocks`` holding the KV of ``tokens`` (whole blocks). Parts already cached keep
        their existing blocks (the caller's duplicates stay the caller's); returns the deepest
        node covering ``tokens``, whose path ends exactly at ``len(blocks)`` blocks.

        ``start=(node, num_blocks)``: a locked node known to end at ``num_blocks`` blocks of this
        same key, so the walk resumes there instead of at the root (a growing request's insert
        costs its new blocks, not its whole length)."""
        n = len(blocks) * self.bs
        assert len(tokens) >= n
        node, i, now = self._root(extra_key), 0, next(self._clock)
        if start is not None:
            node, i = start[0], start[1] * self.bs
        while i < n:
            child = node.children.get(self._first(tokens, i))
            if child is None:
                new_blocks = list(blocks[i // self.bs :])
                child = TreeNode(tuple(tokens[i:n]), new_blocks, node)
                node.children[child.key[: self.bs]] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.pool.mark_cached(new_blocks)
                self.evictable_size += len(new_blocks)
                child.last_access = now
                return child
            m = self._match_len(child.key, tokens, i, n)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            node, i = child, i + m
        return node

    # -- locking ------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.value)
                self.protected_size += len(node.value)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            if node.lock_ref == 1:
                self.evictable_size += len(node.value)
                self.protected_size -= len(node.value)
                if not node.children:
                    self._leaves.add(node)
            node.lock_ref -= 1
            node = node.parent

    # -- eviction -----------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` unlocked blocks, LRU leaves first; returns blocks freed."""
        if num_blocks <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            if self.on_evict is not None:
                self.on_evict(node)
            del parent.children[node.key[: self.bs]]
            self._leaves.discard(node)
            self.pool.uncache(node.value)
            self.evictable_size -= len(node.value)
            freed += len(node.value)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def path(self, node: TreeNode) -> tuple[list[int], list[int], Hashable]:
        """``(tokens, blocks, extra_key)`` of the whole prefix ``node`` ends."""
        keys, values = [], []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for k in reversed(keys) for t in k]
        blocks = [b for v in reversed(values) for b in v]
        return tokens, blocks, self._root_keys[id(node)]

    def reset(self) -> None:
        """Drop every unlocked node (e.g. after weights change)."""
        self.evict(self.evictable_size)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def check_integrity(self) -> None:
        seen: set[int] = set()
        evictable = protected = 0
        leaves = set()
        for node in self._nodes():
            if not node.children and node.lock_ref == 0:
                leaves.add(node)
            assert len(node.key) == len(node.value) * self.bs and node.value, "bad node size"
            assert node.parent is not None and node.parent.children.get(node.key[: self.bs]) is node
            assert node.lock_ref >= 0
            assert node.parent.lock_ref >= node.lock_ref or node.parent.parent is None
            for b in node.value:
                assert b not in seen, f"block {b} in two nodes"
                assert self.pool.cached[b], f"block {b} in the tree but not marked cached"
                seen.add(b)
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"counters {self.evictable_size}/{self.protected_size} != {evictable}/{protected}"
        )
        assert all(self.pool.cached[b] == (b in seen) for b in range(self.pool.num_blocks))
        assert leaves == self._leaves, "the set of evictable leaves is stale"
