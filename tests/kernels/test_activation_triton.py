from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("shape", [(4, 128), (3, 600), (2, 2, 64)])
def test_silu_and_mul_matches_ref(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 4
    out = silu_and_mul(x)
    inter = shape[-1] // 2
    assert out.shape == (*shape[:-1], inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.silu(x[..., :inter]) * x[..., inter:], atol=1e-5, rtol=1e-5)
