"""KVCacheManager: block tables of requests over one BlockPool, with optional radix prefix reuse.

Per request it keeps the block table, the locked radix node of its cached prefix and how many of
its leading blocks are known to the cache. Allocation evicts unlocked cached blocks when the
free list runs short; the scheduler preempts when even that is not enough.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from fulcrum.kv_cache.block_pool import BlockPool
from fulcrum.kv_cache.radix_cache import RadixCache, TreeNode


@dataclass
class _ReqBlocks:
    blocks: list[int] = field(default_factory=list)
    node: TreeNode | None = None  # locked radix node of the cached prefix
    num_cached_blocks: int = 0  # leading blocks known to the cache (matched or inserted)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        self._reqs: dict[str, _ReqBlocks] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free plus evictable."""
        return self.pool.num_free + (self.tree.evictable_size if self.tree else 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-idle blocks count as free)."""
        return 1.0 - self.num_available / self.pool.num_blocks

    def block_table(self, req_id: str) -> list[int]:
        return self._reqs[req_id].blocks

    def has(self, req_id: str) -> bool:
        return req_id in self._reqs

    # -- admission ----------------------------------------------------------------------------

    def match_prefix(self, prompt: Sequence[int], extra_key: Hashable) -> tuple[list[int], TreeNode | None]:
        """Cached blocks for ``prompt`` (never its last token: that one's logits are needed)."""
        if self.tree is None or len(prompt) < 2:
            return [], None
        return self.tree.match_prefix(prompt[: len(prompt) - 1], extra_key)

    def admit(self, req_id: str, prefix_blocks: list[int], node: TreeNode | None) -> int:
        """Start tracking ``req_id`` with shared ``prefix_blocks``; returns tokens reused."""
        assert req_id not in self._reqs
        rb = _ReqBlocks(list(prefix_blocks), node, len(prefix_blocks) if node else 0)
        self.pool.incref(rb.blocks)
        if node is not None and self.tree is not None:
            self.tree.inc_lock_ref(node)
        self._reqs[req_id] = rb
        return len(prefix_blocks) * self.block_size

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        if self.tree is not None:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens; False if out of blocks."""
        rb = self._reqs[req_id]
        need = -(-num_tokens // self.block_size) - len(rb.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            if self.tree is None or need > self.num_available:
                return False
            self.tree.evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                return False
        rb.blocks.extend(self.pool.allocate(need))
        return True

    def truncate(self, req_id: str, num_tokens: int) -> int:
        """Free the request's blocks beyond those holding ``num_tokens`` tokens (rejected
        speculative tokens' slots); returns the table's new length. Cached blocks are never
        among them: only full blocks of verified tokens enter the cache."""
        rb = self._reqs[req_id]
        keep = max(-(-num_tokens // self.block_size), rb.num_cached_blocks)
        if keep < len(rb.blocks):
            self.pool.decref(rb.blocks[keep:])
            del rb.blocks[keep:]
        return len(rb.blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available

    # -- caching ------------------------------------------------------------------------------

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int, extra_key: Hashable) -> None:
        """Insert the request's full, computed blocks into the radix cache."""
        if self.tree is None:
            return
        rb = self._reqs[req_id]
        full = min(num_computed // self.block_size, len(rb.blocks))
        if full <= rb.num_cached_blocks:
            return
        start = (rb.node, rb.num_cached_blocks) if rb.node is not None else None
        node = self.tree.insert(
            token_ids[: full * self.block_size], rb.blocks[:full], extra_key, start=start
        )
        self.tree.inc_lock_ref(node)
        if rb.node is not None:
            self.tree.dec_lock_ref(rb.node)
        rb.node, rb.num_cached_blocks = node, full

    # -- release ------------------------------------------------------------------------------

    def free(self, req_id: str) -> None:
        rb = self._reqs.pop(req_id, None)
        if rb is None:
            return
        if rb.node is not None and self.tree is not None:
            self.tree.dec_lock_ref(rb.node)
        self.pool.decref(rb.blocks)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for rb in self._reqs.values():
            for b in rb.blocks:
                refs[b] += 1
        assert refs == self.pool.ref_cnt, "ref counts differ from the block tables"
        if self.tree is not None:
            self.tree.check_integrity()
