"""RMSNorm with an optional fused residual add (Triton on CUDA, torch elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.kernels.dispatch import Configured, use_triton


class RMSNorm(Configured, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        kc = self.kernel_config
        if use_triton(x, kc):
            from fulcrum.kernels import rmsnorm

            first = kc.rmsnorm_weight_first
            if residual is None:
                return rmsnorm.rms_norm(x, self.weight, self.eps, kc.pdl, first)
            return rmsnorm.fused_add_rms_norm(x, residual, self.weight, self.eps, kc.pdl, first)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)
