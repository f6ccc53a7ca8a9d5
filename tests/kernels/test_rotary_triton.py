from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.rotary import apply_rotary, apply_rotary_ref


def _cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _hf_rotary(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """transformers' Llama rotary: emb = cat(freqs, freqs); x*cos + rotate_half(x)*sin."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (6, 2, 128)])
def test_rotary_matches_ref_and_hf(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(num_heads)
    t = 7
    # q and k as strided views of one fused qkv output, rotated in place.
    qkv = torch.randn(t, num_heads + 2 * num_kv_heads, head_dim, generator=g)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    pos = torch.randint(0, 500, (t,), generator=g)
    cache = _cos_sin_cache(512, head_dim)
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), pos, cache)
    hf_q = _hf_rotary(q.clone(), pos)
    out_q, out_k = apply_rotary(q, k, pos, cache)
    torch.testing.assert_close(out_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_q, hf_q, atol=1e-4, rtol=1e-4)
    assert out_q.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, :num_heads], out_q)  # in place
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)


def test_partial_rotary_leaves_tail() -> None:
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 2, 64, generator=g), torch.randn(3, 1, 64, generator=g)
    pos = torch.tensor([0, 9, 31])
    cache = _cos_sin_cache(32, 32)
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), pos, cache)
    tail = q[..., 32:].clone()
    out_q, out_k = apply_rotary(q, k, pos, cache)
    torch.testing.assert_close(out_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(out_q[..., 32:], tail)
    torch.testing.assert_close(out_q[0], ref_q[0])  # position 0 is the identity


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_rotary_with_kv_write_matches_rotary_then_cache(cache_dtype: torch.dtype) -> None:
    """The fused path (rotate q and k, write rotated k and v into the paged cache) against the
    two kernels it replaces: same q/k, same cache bytes; padding slots (-1) write nothing."""
    from paged_batch import make_paged_batch

    from fulcrum.kernels.reshape_and_cache import reshape_and_cache

    g = torch.Generator().manual_seed(11)
    hq, hkv, d = 6, 2, 64
    cache, meta = make_paged_batch([9, 1, 23], [9, 1, 5], hkv, d, 4, num_pad_tokens=3, generator=g)
    cache = (cache * 0.5).to(cache_dtype)
    t = meta.num_tokens
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g)
    pos = torch.randint(0, 500, (t,), generator=g)
    cs = _cos_sin_cache(512, d)

    def views(x):
        return x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]

    want_qkv, want_cache, before = qkv.clone(), cache.clone(), cache.clone()
    q, k, v = views(want_qkv)
    apply_rotary(q, k, pos, cs)
    reshape_and_cache(k, v, want_cache, meta.slot_mapping)
    q, k, v = views(qkv)
    apply_rotary(q, k, pos, cs, kv_write=(v, cache, meta.slot_mapping))
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # it wrote


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_qk_norm_matches_norms_then_rotary(dtype: torch.dtype) -> None:
    """``qk_norm``: each head of q and of k RMSNormed (Qwen3) in the rotary kernel, in place on
    the strided views of qkv, against ``rms_norm`` on contiguous copies then rotary + the
    cache write: same q and k to the dtype's rounding (the sum of squares adds the two halves
    apart), same cache rows."""
    from paged_batch import make_paged_batch

    from fulcrum.kernels.rmsnorm import rms_norm

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, eps = 6, 2, 32, 1e-6
    cache, meta = make_paged_batch([9, 1, 23], [9, 1, 5], hkv, d, 4, generator=g)
    t = meta.num_tokens
    qkv = (torch.randn(t, hq + 2 * hkv, d, generator=g) * 3).to(dtype)
    cache = cache.to(dtype)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    pos = torch.randint(0, 500, (t,), generator=g)
    cs = _cos_sin_cache(512, d)

    def views(x):
        return x[:, :hq], x[:, hq : hq + hkv], x[:, hq + hkv :]

    q, k, v = views(qkv.clone())
    q = rms_norm(q.contiguous().view(-1, d), qw, eps).view(t, hq, d)
    k = rms_norm(k.contiguous().view(-1, d), kw, eps).view(t, hkv, d)
    want_cache = cache.clone()
    want_q, want_k = apply_rotary(q, k, pos, cs, kv_write=(v, want_cache, meta.slot_mapping))
    got_qkv = qkv.clone()
    q, k, v = views(got_qkv)
    got_cache = cache.clone()
    apply_rotary(q, k, pos, cs, kv_write=(v, got_cache, meta.slot_mapping), qk_norm=(qw, kw, eps))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    torch.testing.assert_close(got_cache, want_cache, **tol)
    assert torch.equal(v, views(qkv)[2])  # v passes through
    with pytest.raises(ValueError, match="qk_norm"):
        apply_rotary(q, k, pos, _cos_sin_cache(512, d // 2), qk_norm=(qw, kw, eps))
