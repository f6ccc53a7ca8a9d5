"""Whether a layer should call its Triton kernel: CUDA tensors, kernels importable, not disabled."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _kernels_ok() -> bool:
    if os.environ.get("FULCRUM_DISABLE_TRITON_KERNELS") == "1":
        return False
    try:
        import triton  # noqa: F401

        from fulcrum.kernels import activation, rmsnorm, rotary  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _kernels_ok()
