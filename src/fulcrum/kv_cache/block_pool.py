"""The pool of KV blocks: a free list and per-block reference counts.

A block is in exactly one of three states::

    free        ref_cnt == 0, not cached    → on the free list
    in use      ref_cnt  > 0                → held by one or more running requests
    evictable   ref_cnt == 0, cached        → owned by the radix cache, reclaimable

The radix cache tells the pool which blocks it owns (``cached``); a cached block returns to the
free list only when the cache evicts it.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self._free)} free.")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_cnt[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} freed twice"
            if self.ref_cnt[b] == 0 and not self.cached[b]:
                self._free.append(b)

    def mark_cached(self, blocks: list[int]) -> None:
        for b in blocks:
            self.cached[b] = True

    def uncache(self, blocks: list[int]) -> None:
        """The radix cache dropped these blocks: unreferenced ones become free."""
        for b in blocks:
            self.cached[b] = False
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            if b in free:
                assert self.ref_cnt[b] == 0 and not self.cached[b], f"block {b} free but in use"
            else:
                assert self.ref_cnt[b] > 0 or self.cached[b], f"block {b} leaked"
