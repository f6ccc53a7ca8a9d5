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


def _gemv_row(x: torch.Tensor, layer: nn.Module):
    """(weight, bias, scale) when ``layer`` runs the GEMV for ``x`` (one row on CUDA), else
    None."""
    operands = getattr(layer, "gemv_operands", None)
    if x.shape[0] != 1 or x.dim() != 2 or operands is None or not use_triton(x):
        return None
    from fulcrum.kernels import gemv

    ops = operands()
    return ops if gemv.use_gemv(x, ops[0]) else None


def fused_norms(x: torch.Tensor, norm: RMSNorm) -> bool:
    """Whether this step runs the norms fused into the one-row GEMVs around them: the residual
    added in the producing GEMV (``residual_linear``), the norm in the consuming one
    (``norm_linear`` with ``norm`` folded, ``fold_norm``)."""
    if not getattr(norm, "folded", False) or x.shape[0] != 1 or not use_triton(x):
        return False
    from fulcrum.kernels import gemv

    return gemv.FUSE_NORM


def fold_norm(norm: RMSNorm, layer: nn.Module) -> None:
    """Fold ``norm``'s weight into the columns of the projection after it, ``W' = W diag(w)``,
    and make the norm's own weight ones: every path computes the same function, and a one-row
    GEMV can apply the norm as one scale of its sums (``gemv.norm_gemv``)."""
    with torch.no_grad():
        w = layer.weight
        w.copy_((w.float() * norm.weight.float()[None, :]).to(w.dtype))
        norm.weight.fill_(1.0)
    norm.folded = True


def norm_linear(
    norm: RMSNorm,
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(h)), h)`` with ``h = x`` or ``x + residual``; with ``silu``,
    ``silu_and_mul`` of the projection (gate_up). Where the projection runs the one-row GEMV:
    with the norms fused (``fused_norms``; ``x`` then already holds the residual) the norm is
    part of the GEMV (``gemv.norm_gemv``), and with ``gemv.FUSE_SILU`` so is the activation
    (``gemv.silu_gemv``): their launches, and their trips through memory, drop out."""
    eps = None
    if residual is None:
        h = x
        if fused_norms(x, norm) and _gemv_row(x, layer) is not None:
            eps = norm.eps
        else:
            x = norm(x)
    else:
        x, h = norm(x, residual)
    ops = _gemv_row(x, layer) if eps is not None or silu else None
    if ops is not None:
        from fulcrum.kernels import gemv

        weight, bias, scale = ops
        if silu and gemv.FUSE_SILU:
            return gemv.silu_gemv(x, weight, bias, scale=scale, eps=eps), h
        if eps is not None:
            y = gemv.norm_gemv(x, eps, weight, bias, scale=scale)
            return (silu_and_mul(y) if silu else y), h
    y = layer(x)
    return (silu_and_mul(y) if silu else y), h


def residual_linear(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``layer(x) + residual``; one kernel where ``layer`` runs the GEMV (the add in its
    epilogue)."""
    ops = _gemv_row(x, layer)
    if ops is None:
        return layer(x) + residual
    from fulcrum.kernels import gemv

    weight, bias, scale = ops
    return gemv.gemv(x, weight, bias, scale=scale, residual=residual)
