"""Gated activation of the Llama MLP: ``silu(gate) * up`` over a fused ``[gate | up]`` row."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.quant_fp8 import launch_rows_fp8, store_row_fp8


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


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, I: tl.constexpr, BLOCK: tl.constexpr,  # noqa: E741
    PDL: tl.constexpr,
):
    # One program per row: the row's scale needs all of it. The product is rounded to the input
    # dtype first, as ``silu_and_mul`` stores it, so the bytes equal the two kernels' in turn.
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype).to(tl.float32)
    store_row_fp8(y, q_ptr + row * stride_q, s_ptr, row, offs, mask)


def silu_and_mul_quant_fp8(
    x: torch.Tensor, pdl_cfg: PdlConfig = pdl.DEFAULT
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_quant_fp8(silu_and_mul(x))`` in one kernel, for an FP8 GEMM next:
    ``x [T, 2I]`` -> ``(q [T, I] float8_e4m3fn, scale [T, 1] float32)``."""
    assert x.dim() == 2 and x.shape[-1] % 2 == 0
    if x.stride(-1) != 1:
        x = x.contiguous()
    inter = x.shape[1] // 2
    return launch_rows_fp8(_silu_and_mul_quant_kernel, x, inter, pdl_cfg, I=inter)


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
