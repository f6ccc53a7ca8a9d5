"""Per-token FP8 quantization against its torch reference.

Inputs are built from e4m3 values times a power-of-two row scale, so every quotient the kernel
converts is exactly representable: Triton's CPU interpreter rounds some fp32 -> e4m3
conversions wrongly where rounding carries into the exponent (127.99 -> 64), which the GPU does
not (tests/gpu compares random inputs there)."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.quant_fp8 import FP8, per_token_quant_fp8, per_token_quant_fp8_ref


def _rows(t: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, q, s)`` with ``x = q * s``: e4m3 rows reaching +-448, power-of-two scales."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    sign = torch.where(torch.rand(t, generator=g) < 0.5, -448.0, 448.0)
    q[:, seed % k] = sign.to(FP8)
    s = 2.0 ** torch.randint(-12, 8, (t, 1), generator=g).float()
    return q.float() * s, q, s


@pytest.mark.parametrize(("t", "k"), [(1, 64), (5, 96), (3, 300)])
def test_per_token_quant_matches_ref(t: int, k: int) -> None:
    x, want_q, want_s = _rows(t, k, seed=t * k)
    q, s = per_token_quant_fp8(x)
    rq, rs = per_token_quant_fp8_ref(x)
    assert q.dtype == FP8 and s.shape == (t, 1) and s.dtype == torch.float32
    assert torch.equal(s, rs) and torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_ref_rounds_within_half_a_step() -> None:
    """The reference on arbitrary rows: the largest magnitude maps to 448 and every value in
    e4m3's normal range comes back within half its relative step (3 mantissa bits)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    q, s = per_token_quant_fp8_ref(x)
    assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0))
    normal = x.abs() >= s * 2.0**-6
    assert ((q.float() * s - x).abs() <= x.abs() * 2.0**-4)[normal].all()


def test_zero_rows_stay_zero() -> None:
    """Padding rows of a captured step are all zero: scale floor, no NaN."""
    x = torch.zeros(2, 32)
    x[1, 4] = 3.0
    q, s = per_token_quant_fp8(x)
    assert torch.isfinite(s).all() and torch.equal(q[0].float(), torch.zeros(32))
    assert q[1, 4].float() == 448.0 and s[1, 0] == pytest.approx(3.0 / 448.0)
