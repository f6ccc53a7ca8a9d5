from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from fulcrum.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_ref,
    prefill_work,
)

# (num_heads, num_kv_heads, head_dim, page_size): GQA ratios 1, 3, 4.
SHAPES = [(2, 2, 64, 4), (6, 2, 64, 16), (8, 2, 128, 4)]

# seq_lens / query_lens: a fresh prefill, prefix + chunk, a decode, a chunk ending mid-page,
# and a chunk longer than one query block.
BATCH = ([13, 40, 30, 7, 45], [13, 17, 1, 2, 45])


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
def test_prefill_matches_ref(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int
) -> None:
    g = torch.Generator().manual_seed(num_heads + page_size)
    seq_lens, query_lens = BATCH
    cache, meta = make_paged_batch(
        seq_lens, query_lens, num_kv_heads, head_dim, page_size, generator=g
    )
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out = prefill_attention(*args, meta.max_query_len, 0.125)
    ref = prefill_attention_ref(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_prefill_skip_decode_leaves_single_token_rows() -> None:
    g = torch.Generator().manual_seed(11)
    seq_lens, query_lens = [10, 21, 6], [1, 5, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 1, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 3, 64, generator=g)
    out = torch.full_like(q, -3.0)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    prefill_attention(*args, meta.max_query_len, 0.2, out=out, skip_decode=True)
    ref = prefill_attention_ref(*args, 0.2)
    torch.testing.assert_close(out[1:6], ref[1:6], atol=2e-5, rtol=1e-4)
    assert (out[0] == -3.0).all() and (out[6] == -3.0).all()


def test_prefill_work_lists_each_query_block_once_heaviest_first() -> None:
    # query lens 1 (decode), 5, 0, 9 with prefixes 9, 16, 3, 0; blocks of 4 query tokens
    qsl, seq_lens = [0, 1, 6, 6, 15], [10, 21, 3, 9]
    work = prefill_work(qsl, seq_lens, 4, skip_decode=True)
    assert sorted(map(tuple, work.tolist())) == [(1, 0), (1, 1), (3, 0), (3, 1), (3, 2)]
    keys = [
        seq_lens[b] - (qsl[b + 1] - qsl[b]) + min(4 * (j + 1), qsl[b + 1] - qsl[b])
        for b, j in work.tolist()
    ]
    assert keys == sorted(keys, reverse=True)  # most keys first
    with_decode = prefill_work(qsl, seq_lens, 4, skip_decode=False).tolist()
    assert [0, 0] in with_decode and len(with_decode) == 6
    assert prefill_work([0, 1, 2], [5, 9], 4, skip_decode=True).shape == (0, 2)


@pytest.mark.parametrize(("page_size", "head_dim"), [(16, 64), (4, 64), (32, 48)])
def test_prefill_fp8_cache_matches_ref(page_size: int, head_dim: int) -> None:
    """FP8 cache, V blocks token-major: pages shorter and longer than the tile, padded head_dim."""
    g = torch.Generator().manual_seed(31)
    seq_lens, query_lens = BATCH
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, head_dim, page_size, generator=g)
    cache = cache.to(torch.float8_e4m3fn)
    q = torch.randn(meta.num_tokens, 6, head_dim, generator=g)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out = prefill_attention(*args, meta.max_query_len, 0.125)
    ref = prefill_attention_ref(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 0.5), (9, 0.7)])
def test_prefill_window_and_softcap_match_ref(window: int | None, softcap: float | None) -> None:
    """Sliding windows shorter than the chunks and the prefixes, soft-capped scores (Gemma)."""
    g = torch.Generator().manual_seed(7)
    seq_lens, query_lens = BATCH
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 4, 64, generator=g)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out = prefill_attention(*args, meta.max_query_len, 0.125, window=window, softcap=softcap)
    ref = prefill_attention_ref(*args, 0.125, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    if window:  # the window changes the answer
        assert not torch.allclose(ref, prefill_attention_ref(*args, 0.125, softcap=softcap))
