"""The radix-cache simulation: known overlaps, hand-computed evictions, a brute-force check."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.analyze.overlap import simulate_overlap
from fulcrum.analyze.radix_sim import RadixCacheSim
from fulcrum.analyze.trace import TraceRecord


def _rec(i: int, ids: list[int], salt: str | None = None) -> TraceRecord:
    return TraceRecord(str(i), float(i), "completions", ids, len(ids), 8, cache_salt=salt)


def _unique(rng: random.Random, n: int, base: int) -> list[int]:
    return [base] + [rng.randrange(1000, 50000) for _ in range(n - 1)]


def test_all_unique_is_zero() -> None:
    rng = random.Random(0)
    recs = [_rec(i, _unique(rng, 100, i)) for i in range(20)]
    rep = simulate_overlap(recs, None, 16)
    assert rep.hit_tokens == 0 and rep.overlap == 0.0


def test_one_shared_prefix_exact_fraction() -> None:
    rng = random.Random(1)
    prefix = list(range(100, 164))  # 64 tokens = 4 blocks of 16
    recs = [_rec(i, prefix + _unique(rng, 20, 90000 + i)) for i in range(10)]
    rep = simulate_overlap(recs, None, 16)
    assert rep.hit_tokens == 9 * 64
    assert rep.overlap == 9 * 64 / (10 * 84)
    assert rep.per_request_hits == [0] + [64] * 9


def test_token_granular_prefix_not_block_aligned() -> None:
    rng = random.Random(2)
    prefix = list(range(100, 150))  # 50 tokens
    recs = [_rec(i, prefix + _unique(rng, 7, 90000 + i)) for i in range(4)]
    assert simulate_overlap(recs, None, 16).hit_tokens == 3 * 48  # 3 full blocks
    assert simulate_overlap(recs, None, 1).hit_tokens == 3 * 50


def test_fully_cached_prompt_still_computes_one_token() -> None:
    sim = RadixCacheSim(None, 16)
    p = list(range(64))
    assert sim.access(p) == 0
    assert sim.access(p) == 48  # 63 tokens at most, rounded down to blocks
    assert RadixCacheSim(None, 1).access(p) == 0


def _alternating() -> list[TraceRecord]:
    a, b = list(range(1000, 1064)), list(range(2000, 2064))  # two 4-block prefixes
    prompts = [a + list(range(5000, 5016)), b + list(range(6000, 6016))]
    prompts += [a + list(range(7000, 7016)), b + list(range(8000, 8016))]
    return [_rec(i, p) for i, p in enumerate(prompts)]  # A B A B, 5 blocks each


def test_capacity_too_small_hand_computed() -> None:
    recs = _alternating()
    # Unbounded: the 3rd and 4th requests hit their 64-token prefix: 128 / 320.
    assert simulate_overlap(recs, None, 16).overlap == 128 / 320
    # 5 blocks hold one prompt: each request evicts the other prefix entirely -> 0.
    assert simulate_overlap(recs, 80, 16).hit_tokens == 0
    # 8 blocks. r2 (B, 5 blocks) evicts A's two LRU leaves (suffix, then prefix block 4):
    # r3 hits 3 blocks of A; inserting A's 2 blocks evicts B's suffix and block 4;
    # r4 hits 3 blocks of B. Hits: 48 + 48 = 96 of 320.
    rep = simulate_overlap(recs, 128, 16)
    assert rep.per_request_hits == [0, 0, 48, 48]
    assert rep.overlap == 96 / 320
    # 9 blocks: only suffixes get evicted, prefixes stay: as good as unbounded.
    assert simulate_overlap(recs, 144, 16).hit_tokens == 128


def test_cache_salt_isolates_tenants() -> None:
    p = list(range(100))
    recs = [_rec(0, p, "t1"), _rec(1, p, "t2"), _rec(2, p, "t1")]
    assert simulate_overlap(recs, None, 16).per_request_hits == [0, 0, 96]


def _brute_hit(prev: list[list[int]], p: list[int], bs: int) -> int:
    best = 0
    for q in prev:
        n = 0
        while n < min(len(p), len(q)) and p[n] == q[n]:
            n += 1
        best = max(best, n // bs)
    return min(best, max(len(p) - 1, 0) // bs) * bs


prompts_st = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(
    prompts=prompts_st, bs=st.sampled_from([1, 2, 4]), cap=st.one_of(st.none(), st.integers(0, 60))
)
def test_matches_brute_force_and_stays_consistent(
    prompts: list[list[int]], bs: int, cap: int | None
) -> None:
    sim = RadixCacheSim(cap, bs)
    for i, p in enumerate(prompts):
        hit = sim.access(p)
        assert hit % bs == 0 and hit <= max(len(p) - 1, 0)
        if cap is None:
            assert hit == _brute_hit(prompts[:i], p, bs)
        else:
            assert hit <= _brute_hit(prompts[:i], p, bs)
        sim.check_integrity()
