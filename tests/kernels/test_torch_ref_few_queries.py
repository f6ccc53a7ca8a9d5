"""The torch backend's path for a few query tokens over a cached prefix (a verify step: K/V
gathered into the scratch, GQA inside SDPA) against its general per-request path."""

from __future__ import annotations

import pytest
import torch
from paged_batch import make_paged_batch

from fulcrum.attention import torch_ref
from fulcrum.attention.torch_ref import TorchAttentionBackend


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 0.6)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
def test_few_queries_match_general_path(
    monkeypatch: pytest.MonkeyPatch,
    window: int | None,
    softcap: float | None,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    # decodes, verify-sized queries over a prefix (2 and 5 tokens), a long chunk over a prefix
    seq_lens, query_lens = [19, 40, 30, 9, 50], [1, 5, 2, 9, 20]
    g = torch.Generator().manual_seed(num_heads + (window or 0))
    cache, meta = make_paged_batch(seq_lens, query_lens, num_kv_heads, 32, 4, generator=g)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, 32, generator=g) for h in (num_heads, num_kv_heads, num_kv_heads))

    def run(few: int) -> torch.Tensor:
        monkeypatch.setattr(torch_ref, "_FEW_QUERIES", few)
        meta.backend_cache.clear()
        be = TorchAttentionBackend(num_heads, num_kv_heads, 32, 0.17).for_layer(
            0.17, window, softcap
        )
        return be.forward(q, k, v, cache.clone(), meta)

    limit = torch_ref._FEW_QUERIES
    assert limit >= 9  # the 2-, 5- and 9-token queries take the few-query path
    general, few = run(0), run(limit)
    torch.testing.assert_close(few, general, atol=1e-5, rtol=1e-5)
