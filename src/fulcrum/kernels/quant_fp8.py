"""Per-token dynamic FP8 (e4m3) quantization of activations, for FP8 weight GEMMs.

Each row ``x[t]`` gets its own scale ``s[t] = max(|x[t]|, 1e-12) / 448`` and is stored as
``q[t] = saturate(x[t] / s[t])`` in float8 e4m3 (448 is its largest finite value), so
``x[t] ~= q[t] * s[t]``. One program per row; math in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kv_cache.dtype import FP8_DTYPE as FP8
from fulcrum.kv_cache.dtype import FP8_MAX


@triton.jit
def store_row_fp8(y, q_row_ptr, s_ptr, row, offs, mask):
    """One row ``y`` (fp32, whole in the program) stored as e4m3 at ``q_row_ptr + offs`` with
    its scale at ``s_ptr + row``; kernels that make a GEMM's input rows end with it."""
    scale = tl.maximum(tl.max(tl.abs(y), 0), 1e-12) / 448.0
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    store_row_fp8(x, q_ptr + row * stride_q, s_ptr, row, offs, mask)


def per_token_quant_fp8(
    x: torch.Tensor, pdl_cfg: PdlConfig = pdl.DEFAULT
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(q [T, K] float8_e4m3fn, scale [T, 1] float32)``."""
    assert x.dim() == 2 and x.stride(-1) == 1
    return launch_rows_fp8(_per_token_quant_kernel, x, x.shape[1], pdl_cfg, K=x.shape[1])


def launch_rows_fp8(
    kernel: Any, x: torch.Tensor, width: int, pdl_cfg: PdlConfig, **args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, width] e4m3, scale [T, 1] fp32)`` from ``kernel``, one program per row of
    ``x [T, *]`` (arguments ``x, q, s, stride_x, stride_q, **args, BLOCK, PDL``), the row whole
    in the program (``store_row_fp8``)."""
    t = x.shape[0]
    q = torch.empty((t, width), dtype=FP8, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = triton.next_power_of_2(width)
        m = pdl.mode(x, t, pdl_cfg)
        kernel[(t,)](
            x, q, s, x.stride(0), q.stride(0), **args, BLOCK=block, PDL=m,
            num_warps=max(1, min(16, block // 1024)), **pdl.launch_options(m),
        )  # fmt: skip
    return q, s


def per_token_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of :func:`per_token_quant_fp8`."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
