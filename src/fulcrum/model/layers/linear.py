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
    norm: RMSNorm,
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(h)), h)`` with ``h = x`` or ``x + residual``; with ``silu``,
    ``silu_and_mul`` of the projection (gate_up), in the projection's own kernel where it runs
    the one-row GEMV on CUDA (``gemv.silu_gemv``, when ``gemv.FUSE_SILU``): the activation's
    launch, and its trip through memory, drop out."""
    if residual is None:
        h, x = x, norm(x)
    else:
        x, h = norm(x, residual)
    operands = getattr(layer, "gemv_operands", None)
    if silu and operands is not None and x.shape[0] == 1 and x.dim() == 2 and use_triton(x):
        from fulcrum.kernels import gemv

        weight, bias, scale = operands()
        if gemv.FUSE_SILU and gemv.use_gemv(x, weight):
            return gemv.silu_gemv(x, weight, bias, scale=scale), h
    y = layer(x)
    return (silu_and_mul(y) if silu else y), h
