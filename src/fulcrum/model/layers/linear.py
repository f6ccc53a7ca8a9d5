"""``nn.Linear`` whose few-row calls on CUDA run the Triton GEMV (``kernels/gemv.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import GEMV_MAX_M
from fulcrum.model.layers.activation import silu_and_mul
from fulcrum.model.layers.dispatch import use_triton
from fulcrum.model.layers.norm import RMSNorm


class Linear(nn.Linear):
    """A decode step of up to ``gemv.USE_MAX_M`` requests (read at each call, so a benchmark
    may switch it; see ``gemv.use_gemv``) runs the GEMV, measured faster than cuBLAS on every
    linear layer of an 8B model at batch 1; anything larger runs the BLAS GEMM."""

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias, per-row scale) as the GEMV takes them (``norm_linear``)."""
        return self.weight, self.bias, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the row count first: a prefill step pays one comparison per layer, not the dispatch
        if x.shape[0] <= GEMV_MAX_M and x.dim() == 2 and use_triton(x):
            from fulcrum.kernels import gemv

            if gemv.use_gemv(x, self.weight):
                return gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def norm_linear(
    norm: RMSNorm, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(h)), h)`` with ``h = x`` or ``x + residual``. A one-row CUDA step whose
    layer runs the GEMV on a 2-byte weight does it in one kernel (``gemv.norm_gemv``, when
    ``gemv.FUSE_NORM``): the norm's own launch, and its trip through memory, drop out."""
    operands = getattr(layer, "gemv_operands", None)
    if x.shape[0] == 1 and x.dim() == 2 and operands is not None and use_triton(x):
        from fulcrum.kernels import gemv

        if gemv.FUSE_NORM:
            weight, bias, scale = operands()
            if weight.element_size() == 2 and gemv.use_gemv(x, weight):
                cfg = gemv.GPU_CONFIG["bf16_norm"]
                return gemv.norm_gemv(
                    x, residual, norm.weight, norm.eps, weight, bias, config=cfg, scale=scale
                )
    if residual is None:
        return layer(norm(x)), x
    h, residual = norm(x, residual)
    return layer(h), residual


def silu_mul_linear(layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``layer(silu_and_mul(gate_up))``: one kernel for a one-row CUDA step whose layer runs
    the GEMV on a 2-byte weight (``gemv.silu_mul_gemv``, when ``gemv.FUSE_SILU``)."""
    operands = getattr(layer, "gemv_operands", None)
    if gate_up.shape[0] == 1 and gate_up.dim() == 2 and operands is not None:
        if use_triton(gate_up):
            from fulcrum.kernels import gemv

            if gemv.FUSE_SILU and gemv.USE_MAX_M >= 1:
                weight, bias, scale = operands()
                if weight.element_size() == 2 and 2 * weight.shape[1] == gate_up.shape[1]:
                    cfg = gemv.GPU_CONFIG["bf16_silu"]
                    return gemv.silu_mul_gemv(gate_up, weight, bias, config=cfg, scale=scale)
    return layer(silu_and_mul(gate_up))
