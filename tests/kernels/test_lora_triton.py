"""The batched LoRA kernels (``kernels/lora.py``) against the per-row torch reference: rows of
several adapters and of the base model (slot 0) in one batch, ranks and widths off the blocks,
the input dimension split across programs or not."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.lora import lora_expand, lora_rows_torch, lora_shrink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "k", "r", "n"),
    # the input split 1, 5, 8 and 4 ways (the last two slices of uneven length against K)
    [(7, 96, 24, 200), (3, 300, 80, 64), (1, 64, 8, 16), (2, 1000, 16, 50), (40, 1000, 16, 24)],
)
def test_shrink_expand_match_torch(dtype: torch.dtype, t: int, k: int, r: int, n: int) -> None:
    g = torch.Generator().manual_seed(t * 1000 + r)
    slots_n = 4
    a = torch.randn(slots_n, r, k, generator=g).to(dtype)
    b = torch.randn(slots_n, n, r, generator=g).to(dtype) * 0.1
    a[0], b[0] = 0, 0  # slot 0: the base model
    x = torch.randn(t, k, generator=g).to(dtype)
    slots = torch.randint(0, slots_n, (t,), generator=g, dtype=torch.int32)
    slots[0] = 0
    y0 = torch.randn(t, n, generator=g).to(dtype)
    want = y0.clone()
    lora_rows_torch(x, want, a, b, slots)
    got = y0.clone()
    partials = lora_shrink(x, a, slots)
    assert partials.shape[1:] == (t, r)
    lora_expand(got, partials, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got[0], y0[0])  # a base-model row is left as it was
