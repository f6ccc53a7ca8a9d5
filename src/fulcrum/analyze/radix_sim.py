"""A radix-cache simulation: how many prompt tokens a prefix cache of a given size would serve.

The cache is a tree of blocks (``block_size`` tokens each; 1 is token-granular). A node's key is
its block's tokens, so a path from a root spells a cached prefix::

    root[salt] ─ [t0..t15] ─ [t16..t31] ─ [t32..t47]      (request A's prompt)
                          └─ [u16..u31]                     (request B shares block 0)

Rules, chosen to match what paged-KV engines (fulcrum, vLLM, SGLang) do:

* Only full blocks are cached and matched; a partial last block is always recomputed.
* At least one prompt token is always computed, so a fully cached prompt gets
  ``len(prompt) - 1`` tokens, rounded down to a block boundary.
* After a request, its prompt's full blocks are inserted (output tokens are not known and are
  not inserted; a multi-turn answer therefore hits only once the next turn re-sends it).
* ``capacity_tokens`` bounds the cached tokens (``None``: unbounded). Over capacity the least
  recently used leaf is evicted first, so a prefix always outlives its extensions. Blocks of
  the current request are touched last; a prompt longer than the cache keeps its head.
* ``extra_key`` (the tenant's ``cache_salt``) selects a separate tree: no sharing across salts.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


class _Node:
    __slots__ = ("key", "parent", "children", "last_access", "alive")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0
        self.alive = True


@dataclass
class CacheStats:
    num_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RadixCacheSim:
    """Replay prompts one at a time through an LRU prefix cache and count hits."""

    def __init__(self, capacity_tokens: int | None = None, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be at least 1, got {block_size}.")
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError(f"cache capacity must be non-negative, got {capacity_tokens}.")
        self.block_size = block_size
        self.capacity_blocks = None if capacity_tokens is None else capacity_tokens // block_size
        self.roots: dict[str | None, _Node] = {}
        self.num_blocks = 0
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        self._tiebreak = itertools.count()
        self._heap: list[tuple[int, int, _Node]] = []

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        b = self.block_size
        return [tuple(tokens[i : i + b]) for i in range(0, len(tokens) - b + 1, b)]

    def match(self, tokens: list[int], extra_key: str | None = None) -> int:
        """Tokens of ``tokens`` a lookup would serve from cache now (no state change)."""
        node = self.roots.get(extra_key)
        matched = 0
        if node is not None:
            for key in self._blocks(tokens):
                child = node.children.get(key)
                if child is None:
                    break
                node, matched = child, matched + 1
        max_hit = max(len(tokens) - 1, 0) // self.block_size
        return min(matched, max_hit) * self.block_size

    def access(self, tokens: list[int], extra_key: str | None = None) -> int:
        """Look up then insert one request's prompt; return its hit tokens and update stats."""
        hit = self.match(tokens, extra_key)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(tokens)
        self.stats.hit_tokens += hit
        self._insert(tokens, extra_key)
        return hit

    def _insert(self, tokens: list[int], extra_key: str | None) -> None:
        if self.capacity_blocks == 0:
            return
        node = self.roots.setdefault(extra_key, _Node((), None))
        path: list[_Node] = []
        for key in self._blocks(tokens):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node)
                node.children[key] = child
                self.num_blocks += 1
            path.append(child)
            node = child
        # Touch root-to-leaf so that, among this request's blocks, the tail is evicted first.
        for n in reversed(path):
            n.last_access = next(self._clock)
        for n in path:
            if not n.children:
                heapq.heappush(self._heap, (n.last_access, next(self._tiebreak), n))
        self._evict()

    def _evict(self) -> None:
        if self.capacity_blocks is None:
            return
        while self.num_blocks > self.capacity_blocks and self._heap:
            stamp, _, n = heapq.heappop(self._heap)
            if not n.alive or n.children or stamp != n.last_access:
                continue  # stale heap entry
            parent = n.parent
            assert parent is not None
            del parent.children[n.key]
            n.alive = False
            self.num_blocks -= 1
            self.stats.evicted_blocks += 1
            if parent.parent is not None and not parent.children:
                heapq.heappush(self._heap, (parent.last_access, next(self._tiebreak), parent))

    def check_integrity(self) -> None:
        """Assert the block count and parent links agree with the tree (used by tests)."""
        count = 0
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            for key, c in n.children.items():
                assert c.parent is n and c.key == key and c.alive
                assert len(key) == self.block_size
                count += 1
                stack.append(c)
        assert count == self.num_blocks, (count, self.num_blocks)
        if self.capacity_blocks is not None:
            assert self.num_blocks <= self.capacity_blocks
