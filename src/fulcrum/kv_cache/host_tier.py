"""A host-memory tier under the device prefix cache (``host_kv_cache_memory``), as SGLang's
hierarchical cache: blocks the device radix cache evicts are copied to host blocks and kept in
a second radix tree; a request whose prefix is found there past what the device still holds
gets those blocks copied back into fresh device blocks, which join the device tree.

    device tree   [sys: d0 d1] ── [user A: d2]            evict [user A] ──► copy d* → h*
    host tree     [sys: h0 h1] ── [user A: h2]            match [sys][user A] ──► copy h2 → d7

A node keeps its whole path on the host (its ancestors' blocks are copied too, once), so the
host tree is a prefix tree like the device one and evicts its own least recently used leaves.
The copies are recorded in order and carried by the step's ``SchedulerOutput``: the runner
makes them before that step's forward, on the stream its kernels run on, so a device block is
copied out before its next owner writes it and copied in before a request reads it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from fulcrum.kv_cache.block_pool import BlockPool
from fulcrum.kv_cache.radix_cache import RadixCache, TreeNode

# (direction, source blocks, destination blocks): "d2h" device -> host, "h2d" host -> device
KVCopy = tuple[str, list[int], list[int]]


class HostTier:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(self.pool, block_size)
        self.copies: list[KVCopy] = []
        self.hit_tokens = 0  # prompt tokens served from the host tier (cumulative)

    def back_up(self, tokens: Sequence[int], device_blocks: list[int], extra_key: Hashable) -> None:
        """Keep a copy of the prefix ``tokens`` (held in ``device_blocks``) on the host, in as
        much as the host tree lacks of it; dropped if the host pool cannot make room."""
        held, node = self.tree.match_prefix(tokens, extra_key)
        need = len(device_blocks) - len(held)
        if need <= 0:
            return
        self.tree.inc_lock_ref(node)  # its path must outlive the eviction below
        try:
            if need > self.pool.num_free:
                self.tree.evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                return
            new = self.pool.allocate(need)
            self.copies.append(("d2h", device_blocks[len(held) :], new))
            self.tree.insert(tokens, held + new, extra_key, start=(node, len(held)))
            self.pool.decref(new)  # the tree owns them
        finally:
            self.tree.dec_lock_ref(node)

    def match(self, tokens: Sequence[int], extra_key: Hashable) -> tuple[list[int], TreeNode]:
        return self.tree.match_prefix(tokens, extra_key)

    def take_copies(self) -> list[KVCopy]:
        out, self.copies = self.copies, []
        return out

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.tree.check_integrity()
