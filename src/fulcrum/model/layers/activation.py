"""SiLU-and-multiply for SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulcrum.config import KernelConfig
from fulcrum.kernels.dispatch import DEFAULT, use_triton


def silu_and_mul(x: torch.Tensor, kc: KernelConfig = DEFAULT) -> torch.Tensor:
    """``x`` is ``[T, 2I]`` (gate | up); returns ``silu(gate) * up``."""
    if use_triton(x, kc):
        from fulcrum.kernels.activation import silu_and_mul as kernel

        return kernel(x, kc.pdl)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
