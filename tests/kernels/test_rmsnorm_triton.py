from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)


@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 96), (1, 200)])
def test_rms_norm_matches_ref(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_rms_norm_matches_hf_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 128, generator=g), torch.randn(128, generator=g)
    var = x.pow(2).mean(-1, keepdim=True)
    hf = w * (x * torch.rsqrt(var + 1e-5))
    torch.testing.assert_close(rms_norm(x, w, 1e-5), hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 100)])
def test_fused_add_rms_norm_matches_ref(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = torch.randn(*shape, generator=g)
    res = torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x0 + res0)
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


def test_weight_read_before_or_after_the_wait_gives_the_same_rows() -> None:
    import fulcrum.kernels.rmsnorm as mod
    from fulcrum.kernels import pdl

    g = torch.Generator().manual_seed(9)
    x, res = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    w = torch.randn(96, generator=g)
    outs = []
    for first in (True, False):
        outs.append(mod.fused_add_rms_norm(x, res, w, 1e-5, pdl.DEFAULT, weight_first=first))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    torch.testing.assert_close(outs[0][0], mod.fused_add_rms_norm_ref(x, res, w, 1e-5)[0])
