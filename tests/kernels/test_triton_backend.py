"""TritonAttentionBackend against the torch reference backend on the same hand-built metadata."""

from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from fulcrum.attention.selector import get_backend_cls
from fulcrum.attention.torch_ref import TorchAttentionBackend
from fulcrum.attention.triton_backend import TritonAttentionBackend
from fulcrum.config import KernelConfig

CASES = {
    # name: (seq_lens, query_lens, num_pad_tokens)
    "pure_decode": ([1, 19, 40, 8], [1, 1, 1, 1], 0),
    "mixed": ([12, 30, 1, 25, 9], [12, 1, 1, 6, 9], 2),
    "prefill_only": ([17, 5], [17, 3], 0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size", "order_min_reqs"),
    # order_min_reqs 1: decode programs take requests longest context first
    [(4, 4, 64, 4, 64), (6, 2, 64, 16, 1), (8, 2, 128, 4, 64)],
)
def test_triton_backend_matches_torch(
    case: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    order_min_reqs: int,
) -> None:
    kc = KernelConfig().replace(attention={"order_min_reqs": order_min_reqs})
    seq_lens, query_lens, pad = CASES[case]
    g = torch.Generator().manual_seed(len(case) * 7 + num_heads + page_size)
    cache, meta = make_paged_batch(
        seq_lens, query_lens, num_kv_heads, head_dim, page_size, num_pad_tokens=pad, generator=g
    )
    t = meta.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    ref_cache = cache.clone()
    out = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, scale, kc).forward(
        q, k, v, cache, meta
    )
    ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale).forward(
        q, k, v, ref_cache, meta
    )
    real = t - pad
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out[:real], ref[:real], atol=2e-5, rtol=1e-4)


def test_registry_finds_triton_backend() -> None:
    assert get_backend_cls("triton", torch.device("cpu")) is TritonAttentionBackend


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("window", "softcap"), [(6, None), (None, 0.6), (4, 0.8)])
def test_triton_backend_window_softcap_matches_torch(
    case: str, window: int | None, softcap: float | None
) -> None:
    """Per-layer copies (``for_layer``) with a sliding window and a score cap (Gemma 2/3)."""
    seq_lens, query_lens, pad = CASES[case]
    g = torch.Generator().manual_seed(len(case) + (window or 0))
    cache, meta = make_paged_batch(seq_lens, query_lens, 2, 64, 4, num_pad_tokens=pad, generator=g)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, 64, generator=g) for h in (4, 2, 2))
    ref_cache = cache.clone()
    base = TritonAttentionBackend(4, 2, 64, 0.125)
    out = base.for_layer(0.2, window, softcap).forward(q, k, v, cache, meta)
    ref = TorchAttentionBackend(4, 2, 64, 0.125).for_layer(0.2, window, softcap)
    ref_out = ref.forward(q, k, v, ref_cache, meta)
    assert base.sliding_window is None and base.scale == 0.125  # the shared one is untouched
    torch.testing.assert_close(out[: t - pad], ref_out[: t - pad], atol=2e-5, rtol=1e-4)
