"""Gated activation of the Llama MLP: ``silu(gate) * up`` over a fused ``[gate | up]`` row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    I: tl.constexpr,  # noqa: E741
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl_cfg: PdlConfig = pdl.DEFAULT) -> torch.Tensor:
    """``x [..., 2I] -> silu(x[..., :I]) * x[..., I:]`` of shape ``[..., I]`` (fp32 math)."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = min(1024 if x.is_cuda else 256, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        m = pdl.mode(x, grid[0] * grid[1], pdl_cfg)
        opts = pdl.launch_options(m)
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), I=inter, BLOCK=block, PDL=m, num_warps=4, **opts
        )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch version of :func:`silu_and_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
