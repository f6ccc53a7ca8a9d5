"""KVCacheManager: block tables of requests over one BlockPool, with optional radix prefix reuse.

Per request it keeps the block table, the locked radix node of its cached prefix and how many of
its leading blocks are known to the cache. Allocation evicts unlocked cached blocks when the
free list runs short; the scheduler preempts when even that is not enough.

With a ``sliding_window`` (every layer windowed: kv_cache/sliding_window.py) a request lets go
of the blocks no later query can see, so a long generation holds about window / block_size
blocks::

    positions   0 ........................ first_pos - window | first_pos ...
    blocks      [released: num_freed ][ held, read by the window ][ held ... ]

Released entries keep their place (and old id) in the table: a block's index is its position
range. Nothing reads them again: the kernels start at the window, the torch reference masks
what it gathers, and a reused id holds some other request's finite K/V. With prefix caching,
such a request caches its prompt blocks only (caching generated blocks would pin the whole
radix path under the request's lock), and drops its lock once it holds none of them, so the
cached prompt becomes evictable while the request runs on.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from fulcrum.kv_cache.block_pool import BlockPool
from fulcrum.kv_cache.host_tier import HostTier, KVCopy
from fulcrum.kv_cache.radix_cache import RadixCache, TreeNode


@dataclass
class _ReqBlocks:
    blocks: list[int] = field(default_factory=list)
    node: TreeNode | None = None  # locked radix node of the cached prefix
    num_cached_blocks: int = 0  # leading blocks known to the cache (matched or inserted)
    num_freed: int = 0  # leading blocks released (out of every layer's window)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
        host_blocks: int = 0,  # the host tier's blocks (host_tier.py; 0: none)
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        self.host: HostTier | None = None
        if host_blocks and self.tree is not None:
            self.host = HostTier(host_blocks, block_size)
            self.tree.on_evict = self._back_up
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

    def num_held(self, req_id: str) -> int:
        """Blocks the request still references (its table less the released ones)."""
        rb = self._reqs[req_id]
        return len(rb.blocks) - rb.num_freed

    def shareable_prefix(self, req_id: str, num_blocks: int) -> list[int]:
        """The request's first ``num_blocks`` blocks for a sibling to share, or none if it has
        released any of them."""
        rb = self._reqs[req_id]
        return [] if rb.num_freed else rb.blocks[:num_blocks]

    # -- admission ----------------------------------------------------------------------------

    def match_prefix(self, prompt: Sequence[int], extra_key: Hashable) -> tuple[list[int], TreeNode | None]:
        """Cached blocks for ``prompt`` (never its last token: that one's logits are needed).
        Blocks found only in the host tier are copied back into fresh device blocks first,
        where the device can make room for them."""
        if self.tree is None or len(prompt) < 2:
            return [], None
        tokens = prompt[: len(prompt) - 1]
        blocks, node = self.tree.match_prefix(tokens, extra_key)
        if self.host is None:
            return blocks, node
        held, host_node = self.host.match(tokens, extra_key)
        need = len(held) - len(blocks)
        if need <= 0:
            return blocks, node
        # neither path may be evicted while room is made (evicting backs blocks up to the host)
        self.tree.inc_lock_ref(node)
        self.host.tree.inc_lock_ref(host_node)
        try:
            if need > self.pool.num_free:
                self.tree.evict(min(need - self.pool.num_free, self.tree.evictable_size))
            if need > self.pool.num_free:
                return blocks, node
            new = self.pool.allocate(need)
            self.host.copies.append(("h2d", held[len(blocks) :], new))
            full = len(held) * self.block_size
            leaf = self.tree.insert(tokens[:full], blocks + new, extra_key, start=(node, len(blocks)))
            self.pool.decref(new)  # the tree owns them until a request takes them
            self.host.hit_tokens += need * self.block_size
            return blocks + new, leaf
        finally:
            self.host.tree.dec_lock_ref(host_node)
            self.tree.dec_lock_ref(node)

    def cached_prefix_blocks(self, prompt: Sequence[int], extra_key: Hashable) -> int:
        """How many leading blocks of ``prompt`` either tier holds, copying nothing (the LPM
        policy's ordering)."""
        if self.tree is None or len(prompt) < 2:
            return 0
        tokens = prompt[: len(prompt) - 1]
        n = len(self.tree.match_prefix(tokens, extra_key)[0])
        return max(n, len(self.host.match(tokens, extra_key)[0])) if self.host is not None else n

    def _back_up(self, node: TreeNode) -> None:
        assert self.tree is not None and self.host is not None
        tokens, blocks, extra_key = self.tree.path(node)
        self.host.back_up(tokens, blocks, extra_key)

    def take_copies(self) -> list[KVCopy]:
        """The block copies between the tiers recorded since the last call, in order."""
        return self.host.take_copies() if self.host is not None else []

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

    def free_out_of_window(self, req_id: str, first_pos: int) -> None:
        """Release the request's blocks wholly before the window of ``first_pos``, the first
        position a step now scheduled queries. Later queries sit further on (a speculative
        rollback stays past it), so no step reads those blocks again; a step still in flight
        runs before any new owner's step writes them."""
        rb = self._reqs[req_id]
        if self.sliding_window is None:
            return
        n = min(max(first_pos - self.sliding_window + 1, 0) // self.block_size, len(rb.blocks))
        if n <= rb.num_freed:
            return
        self.pool.decref(rb.blocks[rb.num_freed : n])
        rb.num_freed = n
        if rb.node is not None and self.tree is not None and n >= rb.num_cached_blocks:
            self.tree.dec_lock_ref(rb.node)  # it holds no block of its cached path any more
            rb.node = None

    # -- caching ------------------------------------------------------------------------------

    def cache_blocks(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed: int,
        extra_key: Hashable,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Insert the request's full, computed blocks into the radix cache (with a sliding
        window, those of its first ``num_prompt_tokens`` tokens only)."""
        if self.tree is None:
            return
        rb = self._reqs[req_id]
        if self.sliding_window is not None:
            if rb.num_freed and rb.node is None:  # unlocked: its path may be gone
                return
            if num_prompt_tokens is not None:
                num_computed = min(num_computed, num_prompt_tokens)
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
        self.pool.decref(rb.blocks[rb.num_freed :])

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for rb in self._reqs.values():
            for b in rb.blocks[rb.num_freed :]:
                refs[b] += 1
        assert refs == self.pool.ref_cnt, "ref counts differ from the block tables"
        if self.tree is not None:
            self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
