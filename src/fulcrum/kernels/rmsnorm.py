"""RMSNorm, plain and fused with the residual add (one program per row).

Numerics follow Hugging Face's ``LlamaRMSNorm``: statistics in fp32, the normalized row rounded to
the input dtype, then multiplied by ``weight``::

    out = weight * (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(h.dtype)

``fused_add_rms_norm`` first forms ``h = x + residual`` (rounded to the input dtype, as the
model's own ``residual + hidden_states`` would be) and returns it as the new residual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.quant_fp8 import store_row_fp8
from fulcrum.kv_cache.dtype import FP8_DTYPE as FP8

# ``weight_first`` (``KernelConfig.rmsnorm_weight_first``): the weight is read before the PDL
# wait. No kernel writes it, and read after the reduction it would be one more memory round trip
# on a one-row step's critical path (``kernels/pdl.py``); measured faster on an H200 at batch 1.


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
    PDL: tl.constexpr,
    QUANT: tl.constexpr = False,  # out is FP8 e4m3 with the row's scale at s_ptr (see below)
    s_ptr=None,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if WEIGHT_FIRST:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    if not WEIGHT_FIRST:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(x.dtype)
    if QUANT:  # per_token_quant_fp8 of the row as the model's dtype holds it: the same bytes
        store_row_fp8(y.to(tl.float32), out_ptr + row * stride_o, s_ptr, row, offs, mask)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pdl_cfg: PdlConfig,
    weight_first: bool,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    flat = x.dim() == 2  # the model's [tokens, hidden]: no reshapes (each costs host time)
    x2 = x if flat else x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype if scales is None else FP8, device=x.device)
    res2 = new_res = None
    if residual is not None:
        res2 = residual if flat else residual.reshape(-1, n)
        if res2.dtype != x.dtype or res2.stride(-1) != 1:
            res2 = res2.to(x.dtype).contiguous()
        new_res = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        block = triton.next_power_of_2(n)
        m = pdl.mode(x, rows, pdl_cfg)
        _rms_norm_kernel[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            new_res if new_res is not None else out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            new_res.stride(0) if new_res is not None else 0,
            eps,
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            WEIGHT_FIRST=weight_first,
            PDL=m,
            QUANT=scales is not None,
            s_ptr=scales,
            num_warps=min(16, max(1, block // 512)),
            **pdl.launch_options(m),
        )
    if flat:
        return out, new_res
    return out.view(x.shape), (new_res.view(x.shape) if new_res is not None else None)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    weight_first: bool = True,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape); output in ``x.dtype``."""
    assert weight.is_contiguous() and weight.shape == (x.shape[-1],)
    return _launch(x, None, weight, eps, pdl_cfg, weight_first)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    weight_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; returns ``(rms_norm(new_residual) * weight, new_residual)``."""
    assert weight.is_contiguous() and weight.shape == (x.shape[-1],)
    assert residual.shape == x.shape
    out, new_res = _launch(x, residual, weight, eps, pdl_cfg, weight_first)
    assert new_res is not None
    return out, new_res


def rms_norm_quant_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    weight_first: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, h)``: ``per_token_quant_fp8(rms_norm(h) * weight)`` with ``h = x`` or
    ``x + residual``, in one kernel: the normed rows never go through memory in the model's
    dtype (an FP8 GEMM takes them next). ``x`` is ``[T, N]``."""
    assert x.dim() == 2 and weight.is_contiguous() and weight.shape == (x.shape[-1],)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    q, new_res = _launch(x, residual, weight, eps, pdl_cfg, weight_first, scales)
    return q, scales, x if new_res is None else new_res


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch version of :func:`rms_norm` (Hugging Face ``LlamaRMSNorm``)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of :func:`fused_add_rms_norm`."""
    new_res = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_res, weight, eps), new_res
