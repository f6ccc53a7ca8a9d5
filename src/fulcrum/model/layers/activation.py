"""SiLU-and-multiply for SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulcrum.kernels.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[T, 2I]`` (gate | up); returns ``silu(gate) * up``."""
    if use_triton(x):
        from fulcrum.kernels.activation import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
