from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from fulcrum.kernels.decode_attention import decode_attention
from fulcrum.kernels.prefill_attention import prefill_attention
from fulcrum.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from fulcrum.kv_cache.dtype import v_rows


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "page_size"), [(1, 64, 4), (3, 64, 16), (2, 128, 16)]
)
def test_reshape_and_cache_matches_ref(num_kv_heads: int, head_dim: int, page_size: int) -> None:
    g = torch.Generator().manual_seed(num_kv_heads * 100 + page_size)
    cache, meta = make_paged_batch(
        [9, 1, 23], [9, 1, 5], num_kv_heads, head_dim, page_size, num_pad_tokens=3, generator=g
    )
    t = meta.num_tokens
    # k and v as strided slices of one fused projection, like the model produces.
    kv = torch.randn(t, 2 * num_kv_heads + 1, head_dim, generator=g)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    ref = cache.clone()
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    reshape_and_cache_ref(k, v, ref, meta.slot_mapping)
    assert torch.equal(cache, ref)
    # The rows really landed where slot_mapping says, and padding wrote nothing.
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    real = meta.slot_mapping >= 0
    assert torch.equal(flat[0, meta.slot_mapping[real]], k[real])
    assert torch.equal(flat[1, meta.slot_mapping[real]], v[real])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[meta.slot_mapping[real]] = False
    assert torch.equal(flat[:, untouched], ref.view_as(flat)[:, untouched])


def test_reshape_and_cache_fp8_saturates() -> None:
    """FP8-representable values land exactly and out-of-range ones saturate to ±448. (Inputs are
    FP8 values in fp32: Triton's CPU interpreter mis-rounds values whose rounding carries into
    the next power of two; rounding of arbitrary values is checked on the GPU.)"""
    g = torch.Generator().manual_seed(5)
    cache, meta = make_paged_batch([9, 4], [9, 4], 2, 64, 4, generator=g)
    cache = cache.to(torch.float8_e4m3fn)
    fp8 = torch.float8_e4m3fn
    k = torch.randn(meta.num_tokens, 2, 64, generator=g).to(fp8).float()
    v = torch.randn(meta.num_tokens, 2, 64, generator=g).to(fp8).float()
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0, 0.5])
    ref = cache.clone()
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    reshape_and_cache_ref(k, v, ref, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    flat = cache.view(2, -1, 2, 64).float()
    assert flat[0, meta.slot_mapping[0], 0, :4].tolist() == [448.0, -448.0, 448.0, 0.5]
    assert torch.equal(v_rows(cache).float().reshape(-1, 2, 64)[meta.slot_mapping], v)
    assert torch.isfinite(flat).all()


@pytest.mark.parametrize("page_size", [4, 16, 32])
def test_fp8_kv_written_then_read_by_the_attention_kernels(page_size: int) -> None:
    """The writer and the readers agree on the FP8 layout (V blocks token-major): K/V written by
    the kernel, then decode and prefill attention against dense attention over the same
    FP8-rounded K/V, computed from the inputs rather than read back from the cache."""
    g = torch.Generator().manual_seed(page_size)
    seq_lens, hq, hkv, d = [7, 40, 33], 4, 2, 64
    cache, meta = make_paged_batch(seq_lens, seq_lens, hkv, d, page_size, generator=g)
    cache = torch.zeros_like(cache).to(torch.float8_e4m3fn)
    t = meta.num_tokens
    # FP8 values in fp32 (the interpreter mis-rounds some others: see the test above)
    k, v = (torch.randn(t, hkv, d, generator=g).to(torch.float8_e4m3fn).float() for _ in "kv")
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    kq, vq = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
    q = torch.randn(t, hq, d, generator=g)
    qsl = meta.query_start_loc_cpu
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out = prefill_attention(*args, meta.max_query_len, d**-0.5)
    last = torch.tensor(qsl[1:]) - 1
    dec = decode_attention(q[last], cache, meta.block_tables, meta.seq_lens, d**-0.5)
    for b in range(len(seq_lens)):
        lo, hi = qsl[b], qsl[b + 1]
        s = torch.einsum("thd,nhd->htn", q[lo:hi], kq[lo:hi]) * d**-0.5
        s = s.masked_fill(torch.ones(hi - lo, hi - lo).triu(1).bool(), float("-inf"))
        want = torch.einsum("htn,nhd->thd", s.softmax(-1), vq[lo:hi])
        torch.testing.assert_close(out[lo:hi], want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(dec[b], want[-1], atol=2e-5, rtol=1e-4)
