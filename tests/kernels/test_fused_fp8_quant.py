"""The kernels that hand an FP8 GEMM its input already quantized (``kernel_config.fuse_fp8_quant``):
RMSNorm (with and without the residual add) and SiLU-and-mul, each fused with the per-token
quantization, give the same bytes and scales as the two kernels in turn, in float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.activation import silu_and_mul, silu_and_mul_quant_fp8
from fulcrum.kernels.quant_fp8 import FP8, per_token_quant_fp8
from fulcrum.kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_quant_fp8


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == FP8 and got[1].dtype == torch.float32 and got[1].shape == want[1].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n"), [(3, 96), (5, 300)])
def test_rms_norm_quant_equals_norm_then_quant(dtype: torch.dtype, t: int, n: int) -> None:
    g = torch.Generator().manual_seed(t * n)
    x = (torch.randn(t, n, generator=g) * 3).to(dtype)
    res = torch.randn(t, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    q, s, h = rms_norm_quant_fp8(x, None, w, 1e-6)
    _same((q, s), per_token_quant_fp8(rms_norm(x, w, 1e-6)))
    assert h is x
    q, s, h = rms_norm_quant_fp8(x, res, w, 1e-6)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    _same((q, s), per_token_quant_fp8(normed))
    assert torch.equal(h, new_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "two_i"), [(4, 128), (3, 600)])
def test_silu_and_mul_quant_equals_the_two_kernels(dtype: torch.dtype, t: int, two_i: int) -> None:
    g = torch.Generator().manual_seed(t + two_i)
    x = (torch.randn(t, two_i, generator=g) * 4).to(dtype)
    _same(silu_and_mul_quant_fp8(x), per_token_quant_fp8(silu_and_mul(x)))
    zero = torch.zeros(2, two_i, dtype=dtype)  # an all-zero row keeps the floor scale
    q, s = silu_and_mul_quant_fp8(zero)
    assert not q.float().any() and torch.all(s == 1e-12 / 448.0)
