from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels.gemv import MAX_M, gemv
from fulcrum.model.layers.linear import Linear


@pytest.mark.parametrize(
    ("m", "n", "k", "bias", "config"),
    [
        (1, 37, 64, False, None),  # rows not a multiple of the tile
        (3, 16, 100, True, None),  # K not a multiple of the tile, bias
        (4, 9, 33, True, (8, 16, 1)),  # several K tiles, ragged last one
        (2, 64, 256, False, (16, 64, 2)),
        (1, 5, 8, True, (4, 64, 1)),  # one K tile wider than K
        (1, 40, 100, True, (8, 32, 2)),  # one row: elementwise products, one final sum
    ],
)
def test_gemv_matches_linear(m: int, n: int, k: int, bias: bool, config) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = gemv(x, w, b, config=config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_gemv_bf16_rounds_once() -> None:
    """bf16 inputs: fp32 accumulation, one rounding of the result (as cuBLAS's GEMV)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 96, generator=g).bfloat16()
    w = torch.randn(24, 96, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float()).bfloat16()
    out = gemv(x, w, config=(8, 32, 1))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=1 / 128)


def test_gemv_strided_rows_and_bad_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 80, generator=g)
    x = base[:, :40]  # row stride 80
    w = torch.randn(12, 40, generator=g)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(MAX_M + 1, 40), w)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(1, 41), w)


def test_linear_is_nn_linear_off_cuda() -> None:
    """Off CUDA the layer is exactly ``nn.Linear`` (same parameters, same result)."""
    torch.manual_seed(0)
    lin = Linear(32, 8, bias=True)
    ref = torch.nn.Linear(32, 8, bias=True)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(1, 32)
    assert torch.equal(lin(x), ref(x))


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_fp8_weight_with_row_scales(m: int) -> None:
    """An e4m3 weight with one fp32 scale per row: ``(x @ q.T) * scale + bias``."""
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, 64, generator=g)
    w = torch.randn(20, 64, generator=g) * 0.05
    b = torch.randn(20, generator=g)
    q, s = quantize_rows(w)
    out = gemv(x, q, b, config=(8, 16, 1), scale=s)
    ref = F.linear(x, q.float()) * s + b
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # and close to the full-precision product (e4m3 keeps ~2 significant digits)
    assert (out - F.linear(x, w, b)).abs().max() < 0.05 * F.linear(x, w).abs().max() + 0.01


def _norm_ref(h: torch.Tensor, nw: torch.Tensor, eps: float) -> torch.Tensor:
    """The normalized row in fp32 (not rounded to h's dtype: the fused kernel never rounds it)."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()


@pytest.mark.parametrize(
    ("residual", "bias", "fp8", "config"),
    [
        (False, False, False, (8, 16, 1)),  # first layer: RMSNorm of x, several K tiles
        (True, True, False, (8, 16, 1)),  # x + residual, bias, a ragged last K tile
        (True, False, False, (4, 128, 2)),  # one K tile wider than K
        (True, False, True, (8, 32, 1)),  # an FP8 weight with row scales
    ],
)
def test_norm_gemv_matches_norm_then_linear(residual: bool, bias: bool, fp8: bool, config):
    """RMSNorm (with the residual add) fused into the GEMV: ``(W (w_n * h)) * rstd``, and
    ``h = x + residual`` returned as the next residual."""
    from fulcrum.kernels.gemv import norm_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(int(residual) + 2 * int(bias) + 4 * int(fp8))
    k, n, eps = 72, 21, 1e-5
    x = torch.randn(1, k, generator=g) * 3
    res = torch.randn(1, k, generator=g) if residual else None
    nw = torch.rand(k, generator=g) + 0.5
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    out, h = norm_gemv(x, res, nw, eps, w, b, config=config, scale=scale)
    want_h = x + res if residual else x
    assert torch.equal(h, want_h)
    wf = w.float() * (scale[:, None] if scale is not None else 1.0)
    ref = F.linear(_norm_ref(want_h, nw, eps), wf, b)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_norm_gemv_bf16_close_to_the_unfused_pair() -> None:
    """bf16: within the unfused norm's rounding of the normalized row of norm-then-GEMV."""
    from fulcrum.kernels.gemv import norm_gemv
    from fulcrum.kernels.rmsnorm import fused_add_rms_norm_ref

    g = torch.Generator().manual_seed(9)
    x, res = (torch.randn(1, 128, generator=g).bfloat16() for _ in range(2))
    nw = (torch.rand(128, generator=g) + 0.5).bfloat16()
    w = (torch.randn(40, 128, generator=g) * 0.05).bfloat16()
    out, h = norm_gemv(x, res, nw, 1e-5, w, config=(8, 32, 1))
    normed, want_h = fused_add_rms_norm_ref(x, res, nw, 1e-5)
    assert out.dtype == torch.bfloat16
    # one bf16 step apart at most: the interpreter casts fp32 -> bf16 by truncation (CUDA
    # rounds to nearest, as torch does)
    torch.testing.assert_close(h.float(), want_h.float(), atol=0, rtol=1 / 128)
    unfused = F.linear(normed.float(), w.float())
    torch.testing.assert_close(out.float(), unfused, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="norm_gemv"):
        norm_gemv(torch.randn(2, 128).bfloat16(), None, nw, 1e-5, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_gemv_matches_activation_then_gemv(dtype: torch.dtype) -> None:
    """silu(gate) * up formed in the GEMV's K loop, rounded as ``silu_and_mul`` rounds it."""
    from fulcrum.kernels.activation import silu_and_mul
    from fulcrum.kernels.gemv import silu_mul_gemv

    g = torch.Generator().manual_seed(21)
    k, n = 40, 13
    gate_up = (torch.randn(1, 2 * k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    out = silu_mul_gemv(gate_up, w, b, config=(8, 16, 1))
    ref = gemv(silu_and_mul(gate_up), w, b, config=(8, 16, 1))
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="silu_mul_gemv"):
        silu_mul_gemv(gate_up[:, :-1], w)
