"""``gather_scatter`` (``out[idx[0]] = src[idx[1]]``) against torch's index ops."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.scatter import gather_scatter


@pytest.mark.parametrize("n", [0, 1, 5, 130])
def test_gather_scatter_matches_index_ops(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    out = torch.randint(0, 1000, (300,), generator=g, dtype=torch.int64)
    src = torch.randint(0, 1000, (200,), generator=g, dtype=torch.int64)
    dst_rows = torch.randperm(300, generator=g)[:n]
    src_rows = torch.randint(0, 200, (n,), generator=g)
    idx = torch.zeros(2, 400, dtype=torch.int64)  # a slice of a wider buffer, like the runner's
    idx[0, :n], idx[1, :n] = dst_rows, src_rows
    ref = out.clone().index_copy_(0, dst_rows, src.index_select(0, src_rows))
    gather_scatter(out, idx[:, :n], src)
    assert torch.equal(out, ref)


def test_gather_scatter_skips_rows_switched_off() -> None:
    """A decode graph's patch has a fixed width: columns whose destination is -1 write nothing
    (their source row may be anything)."""
    out = torch.arange(10, dtype=torch.int64)
    src = torch.arange(100, 108, dtype=torch.int64)
    idx = torch.tensor([[3, -1, 7, -1, -1], [5, 999, 0, -7, 2]], dtype=torch.int64)
    gather_scatter(out, idx, src)
    want = torch.arange(10, dtype=torch.int64)
    want[3], want[7] = 105, 100
    assert torch.equal(out, want)
