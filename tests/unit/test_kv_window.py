"""KV blocks out of every layer's sliding window: released as a request advances, with and
without the radix cache, never double-freed, the cached prompt unpinned once unreferenced;
and the configs/ entries' windows."""

from __future__ import annotations

import os

import pytest

from fulcrum.kv_cache.manager import KVCacheManager
from fulcrum.kv_cache.sliding_window import kv_free_window, layer_windows
from fulcrum.model.loader.hf_config import load_hf_config
from fulcrum.model.loader.resolve import CONFIGS_DIR

BS, W = 4, 10


def _advance(kv: KVCacheManager, rid: str, tokens: list[int], start: int, end: int) -> None:
    """What the scheduler does for a step over positions start..end-1: release, grow, cache."""
    kv.free_out_of_window(rid, start)
    assert kv.allocate_slots(rid, end)
    kv.cache_blocks(rid, tokens, end, None, num_prompt_tokens=12)


@pytest.mark.parametrize("caching", [False, True])
def test_release_as_a_request_advances(caching):
    kv = KVCacheManager(32, BS, caching, sliding_window=W)
    tokens = list(range(100, 200))
    kv.admit("a", [], None)
    _advance(kv, "a", tokens, 0, 12)  # the prompt, one chunk
    assert kv.num_held("a") == 3
    for pos in range(12, 80):
        _advance(kv, "a", tokens, pos, pos + 1)
        kv.check_integrity()
        # blocks before pos - W + 1 are gone: held = the window's blocks plus the current one
        assert kv.num_held("a") == -(-(pos + 1) // BS) - (pos - W + 1) // BS
        assert kv.num_held("a") <= W // BS + 2
    assert len(kv.block_table("a")) == 20  # positions keep their table index
    used = kv.num_blocks - kv.num_available
    assert used == kv.num_held("a")  # the prompt's cached blocks are evictable, not pinned
    if caching:
        assert kv.tree.protected_size == 0 and kv.tree.evictable_size == 3
        # the prompt (12 tokens = 3 blocks) is still there for the next request
        blocks, node = kv.match_prefix(tokens[:13], None)
        assert len(blocks) == 3
    kv.free("a")
    kv.check_integrity()
    assert kv.num_available == kv.num_blocks


def test_prompt_pinned_until_released_then_reused():
    kv = KVCacheManager(32, BS, True, sliding_window=W)
    tokens = list(range(50))
    kv.admit("a", [], None)
    _advance(kv, "a", tokens, 0, 12)
    _advance(kv, "a", tokens, 12, 13)
    assert kv.tree.protected_size == 3  # locked while "a" still reads its prompt
    blocks, node = kv.match_prefix(tokens[:13], None)
    assert kv.admit("b", blocks, node) == 12
    kv.free_out_of_window("b", 12)  # position 12 still sees key 3 (block 0)
    assert kv.num_held("b") == 3
    kv.free_out_of_window("b", 14)  # position 14 sees keys 5.. : block 0 is out
    assert kv.num_held("b") == 2
    kv.check_integrity()
    # a sibling without a cache shares nothing once its parent released blocks
    assert kv.shareable_prefix("b", 3) == []
    assert kv.shareable_prefix("a", 3) == kv.block_table("a")[:3]
    for pos in range(13, 30):
        _advance(kv, "a", tokens, pos, pos + 1)
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.tree.protected_size == 0 and kv.num_available == kv.num_blocks


def test_no_window_releases_nothing():
    kv = KVCacheManager(32, BS, True)
    kv.admit("a", [], None)
    _advance(kv, "a", list(range(100)), 0, 60)
    kv.free_out_of_window("a", 60)
    assert kv.num_held("a") == 15


def test_configs_windows():
    def windows(name: str, max_len: int):
        return layer_windows(load_hf_config(os.path.join(CONFIGS_DIR, name)), max_len)

    assert kv_free_window(windows("phi-3-mini.json", 4096)) == 2047  # every layer: freed
    assert kv_free_window(windows("phi-3-mini.json", 2047)) is None  # full attention
    gemma = windows("gemma-3-12b.json", 8192)
    assert gemma[:6] == [1024] * 5 + [None] and kv_free_window(gemma) is None
    for name in ("mistral-7b.json", "mixtral-8x7b.json", "qwen2.5-7b.json", "qwen3-8b.json"):
        assert set(windows(name, 32768)) == {None}, name
