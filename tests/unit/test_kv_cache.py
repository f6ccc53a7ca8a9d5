"""Block pool and radix cache invariants, including property-based random workloads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.kv_cache.block_pool import BlockPool
from fulcrum.kv_cache.manager import KVCacheManager
from fulcrum.kv_cache.radix_cache import RadixCache


def test_block_pool_states():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.num_free == 3  # a[0] still referenced once
    pool.check_integrity()
    pool.mark_cached(a[:1])
    pool.decref(a[:1])
    assert pool.num_free == 3  # cached: evictable, not free
    pool.uncache(a[:1])
    assert pool.num_free == 4
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_radix_match_split_and_evict():
    pool = BlockPool(16)
    tree = RadixCache(pool, block_size=2)
    blocks = pool.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6]
    node = tree.insert(tokens, blocks)
    pool.decref(blocks)
    assert tree.evictable_size == 3
    got, n = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert got == blocks[:2]  # split after two blocks
    tree.inc_lock_ref(n)
    assert (tree.evictable_size, tree.protected_size) == (1, 2)
    tree.check_integrity()
    assert tree.evict(10) == 1  # only the unlocked leaf goes
    tree.dec_lock_ref(n)
    assert tree.evict(10) == 2
    assert pool.num_free == 16
    tree.check_integrity()
    assert node is not None


def test_salt_isolation():
    pool = BlockPool(8)
    tree = RadixCache(pool, block_size=2)
    b = pool.allocate(2)
    tree.insert([1, 2, 3, 4], b, extra_key="tenant-a")
    assert tree.match_prefix([1, 2, 3, 4], "tenant-b")[0] == []
    assert tree.match_prefix([1, 2, 3, 4], None)[0] == []
    assert tree.match_prefix([1, 2, 3, 4], "tenant-a")[0] == b


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "finish", "abort", "evict"]),
        st.integers(0, 7),  # request slot
        st.lists(st.integers(0, 3), min_size=1, max_size=14),  # tokens (small alphabet: overlaps)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_manager_random_workload(ops, prefix_caching):
    bs = 2
    kv = KVCacheManager(num_blocks=24, block_size=bs, enable_prefix_caching=prefix_caching)
    live: dict[int, list[int]] = {}  # slot -> tokens (computed)
    for op, slot, toks in ops:
        rid = f"r{slot}"
        if op == "add" and slot not in live:
            prompt = [toks[0] % 2] + toks  # shared-ish first token
            blocks, node = kv.match_prefix(prompt, extra_key=slot % 2)
            kv.admit(rid, blocks, node)
            if kv.allocate_slots(rid, len(prompt)):
                live[slot] = prompt
                kv.cache_blocks(rid, prompt, len(prompt), slot % 2)
            else:
                kv.free(rid)
        elif op == "grow" and slot in live:
            new = live[slot] + toks
            if kv.allocate_slots(rid, len(new)):
                live[slot] = new
                kv.cache_blocks(rid, new, len(new), slot % 2)
        elif op in ("finish", "abort") and slot in live:
            kv.free(rid)
            del live[slot]
        elif op == "evict" and kv.tree is not None:
            kv.tree.evict(slot)
        kv.check_integrity()
        for s, toks_ in live.items():
            assert len(kv.block_table(f"r{s}")) * bs >= len(toks_)
    for s in list(live):
        kv.free(f"r{s}")
    kv.check_integrity()
    # Idle: every block is free or cached-and-evictable.
    assert kv.num_available == kv.num_blocks
    if kv.tree is not None:
        assert kv.tree.protected_size == 0


@settings(max_examples=150, deadline=None)
@given(ops)
def test_host_tier_hands_out_blocks_holding_the_prefix(ops):
    """A small device pool over a host tier, each block's content modelled as the prefix it
    holds (the KV of a block depends on every token before it): the copies the manager records,
    made in order before each step's writes, bring back exactly the prefix a match hands out,
    whether its blocks stayed on the device or came back from the host."""
    bs = 2
    kv = KVCacheManager(num_blocks=10, block_size=bs, enable_prefix_caching=True, host_blocks=8)
    dev: dict[int, tuple] = {}
    host: dict[int, tuple] = {}
    live: dict[int, list[int]] = {}

    def copies() -> None:
        for kind, src, dst in kv.take_copies():
            a, b = (dev, host) if kind == "d2h" else (host, dev)
            for s, d in zip(src, dst, strict=True):
                b[d] = a[s]

    def write(slot: int, toks: list[int], start: int) -> None:  # the forward, after the copies
        table = kv.block_table(f"r{slot}")
        for i in range(start // bs, -(-len(toks) // bs)):
            dev[table[i]] = (slot % 2, tuple(toks[: (i + 1) * bs]))

    for op, slot, toks in ops:
        rid = f"r{slot}"
        if op == "add" and slot not in live:
            prompt = [toks[0] % 2] + toks
            blocks, node = kv.match_prefix(prompt, extra_key=slot % 2)
            copies()
            for i, b in enumerate(blocks):
                assert dev[b] == (slot % 2, tuple(prompt[: (i + 1) * bs]))
            kv.admit(rid, blocks, node)
            if kv.allocate_slots(rid, len(prompt)):
                copies()
                write(slot, prompt, len(blocks) * bs)
                live[slot] = prompt
                kv.cache_blocks(rid, prompt, len(prompt), slot % 2)
            else:
                kv.free(rid)
                copies()
        elif op == "grow" and slot in live:
            new = live[slot] + toks
            if kv.allocate_slots(rid, len(new)):
                copies()
                write(slot, new, len(live[slot]))
                live[slot] = new
                kv.cache_blocks(rid, new, len(new), slot % 2)
            copies()
        elif op in ("finish", "abort") and slot in live:
            kv.free(rid)
            del live[slot]
        elif op == "evict":
            kv.tree.evict(slot)
            copies()
        kv.check_integrity()


def test_host_tier_keeps_an_evicted_prefix():
    """A prefix the device evicts is copied to the host (with its ancestors, once) and copied
    back into fresh device blocks when a later prompt starts with it."""
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, host_blocks=8)
    a = [1, 2, 3, 4, 5]
    kv.admit("a", *kv.match_prefix(a, None))
    assert kv.allocate_slots("a", 5)
    kv.cache_blocks("a", a, 5, None)
    a_blocks = kv.block_table("a")[:2]
    kv.free("a")
    kv.admit("b", *kv.match_prefix([7, 8, 9, 10, 11, 12, 13], None))
    assert kv.allocate_slots("b", 7)  # all four blocks: a's cached two are evicted
    ((kind, src, dst),) = kv.take_copies()
    assert kind == "d2h" and src == a_blocks and len(dst) == 2
    kv.free("b")
    blocks, node = kv.match_prefix(a + [6], None)
    assert len(blocks) == 2 and kv.host is not None and kv.host.hit_tokens == 4
    assert kv.take_copies() == [("h2d", dst, blocks)]
    kv.admit("a2", blocks, node)
    kv.check_integrity()
