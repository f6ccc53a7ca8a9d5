from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from fulcrum.kernels.decode_attention import (
    DecodeWorkspace,
    decode_attention,
    decode_attention_ref,
)

# (num_heads, num_kv_heads, head_dim, page_size): GQA ratios 1, 3, 4, 8.
SHAPES = [(4, 4, 64, 4), (6, 2, 64, 16), (8, 2, 128, 16), (8, 1, 64, 4)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_ref(
    num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, num_splits: int
) -> None:
    g = torch.Generator().manual_seed(num_heads * 10 + page_size + num_splits)
    seq_lens = [1, 37, 16, 70]  # ragged; one exactly a page multiple
    cache, meta = make_paged_batch(
        seq_lens, [1] * len(seq_lens), num_kv_heads, head_dim, page_size, generator=g
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    out = decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, num_splits=num_splits)
    ref = decode_attention_ref(q, cache, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_longest_first_order_gives_the_same_rows(num_splits: int) -> None:
    """Programs taken in a permuted request order (longest contexts first) write each request's
    own row, mixed batch included."""
    g = torch.Generator().manual_seed(11 + num_splits)
    seq_lens, query_lens = [5, 40, 9, 33, 18], [1, 1, 3, 1, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 4, 64, generator=g)
    order = torch.argsort(meta.seq_lens, descending=True)
    args = (q, cache, meta.block_tables, meta.seq_lens, 0.1)
    kw = {"query_start_loc": meta.query_start_loc, "num_splits": num_splits}
    plain = decode_attention(*args, out=torch.zeros_like(q), **kw)
    ordered = decode_attention(*args, out=torch.zeros_like(q), order=order, **kw)
    assert torch.equal(plain, ordered)
    rows = meta.query_start_loc[[0, 1, 3, 4]].long()
    ref = decode_attention_ref(
        q[rows], cache, meta.block_tables[[0, 1, 3, 4]], meta.seq_lens[[0, 1, 3, 4]], 0.1
    )
    torch.testing.assert_close(ordered[rows], ref, atol=2e-5, rtol=1e-4)


def test_decode_skips_longer_queries_and_reuses_workspace() -> None:
    """Rows of requests with query_len != 1 stay untouched; the scratch is reused, not regrown."""
    g = torch.Generator().manual_seed(7)
    seq_lens, query_lens = [20, 9, 33], [1, 4, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 4, 64, generator=g)
    out = torch.full_like(q, 7.0)
    ws = DecodeWorkspace()
    for _ in range(2):
        decode_attention(
            q,
            cache,
            meta.block_tables,
            meta.seq_lens,
            0.1,
            query_start_loc=meta.query_start_loc,
            out=out,
            num_splits=4,
            workspace=ws,
        )
    buf = ws._buf
    ws.get(2, 4, 4, 64, q.device)
    assert ws._buf is buf and not ws._retired
    rows = torch.tensor([0, 5])  # query_start_loc of the two decode requests
    ref = decode_attention_ref(
        q[rows], cache, meta.block_tables[[0, 2]], meta.seq_lens[[0, 2]], 0.1
    )
    torch.testing.assert_close(out[rows], ref, atol=2e-5, rtol=1e-4)
    assert (out[1:5] == 7.0).all()


def test_decode_empty_context_gives_zeros() -> None:
    """A padded request (seq_len 0, as in a padded CUDA-graph batch) yields 0, not NaN."""
    g = torch.Generator().manual_seed(3)
    cache, meta = make_paged_batch([5, 5], [1, 1], 1, 64, 4, generator=g)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32)
    q = torch.randn(2, 2, 64, generator=g)
    out = decode_attention(q, cache, meta.block_tables, seq_lens, 0.1, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = decode_attention_ref(q[:1], cache, meta.block_tables[:1], seq_lens[:1], 0.1)
    torch.testing.assert_close(out[:1], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("page_size", "head_dim"), [(16, 64), (4, 64), (32, 48)])
def test_decode_fp8_cache_matches_ref(num_splits: int, page_size: int, head_dim: int) -> None:
    """An FP8 cache (V blocks token-major): the kernel widens K/V to the query's dtype; the
    reference reads the same FP8 values in fp32. Pages longer than the kernel's tile and a
    head_dim padded to a power of two (whose padding must not read the next head's V) too."""
    g = torch.Generator().manual_seed(21 + num_splits)
    seq_lens = [5, 37, 70]
    cache, meta = make_paged_batch(seq_lens, [1] * 3, 2, head_dim, page_size, generator=g)
    cache = cache.to(torch.float8_e4m3fn)
    q = torch.randn(3, 8, head_dim, generator=g)
    out = decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125, num_splits=num_splits)
    ref = decode_attention_ref(q, cache, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("min_split", [16, 32, 100])
def test_decode_min_split_tokens(min_split: int) -> None:
    """Splits of at least ``min_split`` tokens (rounded up to the tile): a short context works
    in fewer splits, the idle ones write lse = -inf, and the rows stay exact."""
    g = torch.Generator().manual_seed(min_split)
    seq_lens = [1, 37, 16, 70, 130]
    cache, meta = make_paged_batch(seq_lens, [1] * len(seq_lens), 2, 64, 4, generator=g)
    q = torch.randn(len(seq_lens), 8, 64, generator=g)
    args = (q, cache, meta.block_tables, meta.seq_lens, 0.125)
    out = decode_attention(*args, num_splits=4, min_split_tokens=min_split)
    ref = decode_attention_ref(*args)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_decode_reads_before_the_wait_give_the_same_rows(num_splits: int) -> None:
    """Small batches read their request rows, lengths and first blocks before the PDL wait
    (``AttentionKernelConfig.pre_wait_max_reqs``): the same rows as the loop that reads them
    after it, with splits of several tiles, a split past a short context and a prefill row to
    skip."""
    from fulcrum.config import AttentionKernelConfig

    g = torch.Generator().manual_seed(20 + num_splits)
    seq_lens, query_lens = [90, 7, 41], [1, 3, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 4, 64, generator=g)
    outs = []
    for most in (4, 0):
        out = torch.full_like(q, 7.0)
        decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, 0.1,
            query_start_loc=meta.query_start_loc, out=out, num_splits=num_splits,
            cfg=AttentionKernelConfig(pre_wait_max_reqs=most),
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    rows = meta.query_start_loc[[0, 2]].long()
    ref = decode_attention_ref(
        q[rows], cache, meta.block_tables[[0, 2]], meta.seq_lens[[0, 2]], 0.1
    )
    torch.testing.assert_close(outs[0][rows], ref, atol=2e-5, rtol=1e-4)
    assert (outs[0][1:4] == 7.0).all()


@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_combine_in_the_split_kernel(num_splits: int) -> None:
    """At a few requests the last split program of each head group combines the splits
    (``AttentionKernelConfig.combine_max_reqs``): the reduce kernel's rows to rounding, with
    splits past a short context (lse -inf) and a prefill row whose programs never count, and
    every counter back at zero after each launch (the second launch reuses them)."""
    from fulcrum.config import AttentionKernelConfig

    g = torch.Generator().manual_seed(30 + num_splits)
    seq_lens, query_lens = [90, 7, 41, 2], [1, 3, 1, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, generator=g)
    q = torch.randn(meta.num_tokens, 8, 64, generator=g)
    ws = DecodeWorkspace()
    outs = []
    for most in (4, 4, 0):
        out = torch.full_like(q, 7.0)
        decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, 0.1, workspace=ws,
            query_start_loc=meta.query_start_loc, out=out, num_splits=num_splits,
            cfg=AttentionKernelConfig(combine_max_reqs=most),
        )  # fmt: skip
        outs.append(out)
        assert not ws.counters(1, q.device).any()
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2], atol=1e-6, rtol=1e-5)
    keep = [0, 2, 3]
    rows = meta.query_start_loc[keep].long()
    ref = decode_attention_ref(
        q[rows], cache, meta.block_tables[keep], meta.seq_lens[keep], 0.1
    )
    torch.testing.assert_close(outs[0][rows], ref, atol=2e-5, rtol=1e-4)
    assert (outs[0][1:4] == 7.0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("window", "softcap"), [(6, None), (None, 0.5), (20, 0.7)])
def test_decode_window_and_softcap_match_ref(
    num_splits: int, window: int | None, softcap: float | None
) -> None:
    """Windows shorter and longer than the contexts, over several splits; soft-capped scores."""
    g = torch.Generator().manual_seed(5 + num_splits)
    seq_lens = [1, 37, 16, 70]
    cache, meta = make_paged_batch(seq_lens, [1] * 4, 2, 64, 4, generator=g)
    q = torch.randn(4, 4, 64, generator=g)
    args = (q, cache, meta.block_tables, meta.seq_lens, 0.125)
    out = decode_attention(*args, num_splits=num_splits, window=window, softcap=softcap)
    ref = decode_attention_ref(*args, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
