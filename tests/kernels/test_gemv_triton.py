from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.gemv import ADD_NORM, NONE, NORM, SILU, gemv, gemv_ref


def _inputs(m: int, n: int, k: int, prologue: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    cols = 2 * k if prologue == SILU else k
    x = (torch.randn(m, cols, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    kw = {"prologue": prologue}
    if prologue == ADD_NORM:
        kw["residual"] = torch.randn(m, k, generator=g).to(dtype)
    if prologue in (NORM, ADD_NORM):
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
        kw["eps"] = 1e-5
    return x, w, kw


@pytest.mark.parametrize("prologue", [NONE, NORM, ADD_NORM, SILU])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 40, 96), (16, 16, 200)])
def test_gemv_matches_ref_fp32(prologue: int, m: int, n: int, k: int) -> None:
    x, w, kw = _inputs(m, n, k, prologue, torch.float32, m * 1000 + n + k + prologue)
    x0 = x.clone()
    out, new_res = gemv(x, w, **kw)
    want, want_res = gemv_ref(x, w, **kw)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x, x0)  # inputs untouched
    if prologue == ADD_NORM:
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    else:
        assert new_res is None


@pytest.mark.parametrize("prologue", [NONE, ADD_NORM, SILU])
def test_gemv_with_bias_and_strided_rows(prologue: int) -> None:
    # (bf16 runs in tests/gpu: Triton's CPU interpreter mis-computes bf16 tl.dot)
    m, n, k = 2, 50, 128
    x, w, kw = _inputs(m, n, k, prologue, torch.float32, 7 + prologue)
    wide = torch.zeros(m, x.shape[1] + 32, dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    xs = wide[:, : x.shape[1]]  # row stride larger than the row
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    out, new_res = gemv(xs, w, bias, **kw)
    want, want_res = gemv_ref(x, w, bias, **kw)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    if prologue == ADD_NORM:
        assert torch.equal(new_res, want_res)


def test_gemv_rejects_too_many_rows() -> None:
    x, w, kw = _inputs(17, 16, 32, NONE, torch.float32, 0)
    with pytest.raises(AssertionError, match="1..16 rows"):
        gemv(x, w, **kw)
