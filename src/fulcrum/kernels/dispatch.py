"""Which kernels a layer calls: the engine's ``KernelConfig``, held by every layer that decides.

A layer that chooses between a Triton kernel and torch (or between two kernels) is a
:class:`Configured` module; the model gets the engine's config at construction and hands it to
each of them (:func:`set_kernel_config`), so two engines in one process may differ. A layer
built on its own (a test) holds ``DEFAULT``, the defaults ``fulcrum.envs`` seeds.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fulcrum.config import KernelConfig

DEFAULT = KernelConfig()


class Configured:
    """Mixin of the modules that read a ``KernelConfig`` (attribute lookups only, per call)."""

    kernel_config: KernelConfig = DEFAULT


def set_kernel_config(root: nn.Module, kc: KernelConfig) -> None:
    """Give ``kc`` to every :class:`Configured` module under ``root`` (``root`` included)."""
    for m in root.modules():
        if isinstance(m, Configured):
            m.kernel_config = kc


@functools.cache
def _kernels_ok() -> bool:
    try:
        import triton  # noqa: F401

        from fulcrum.kernels import activation, rmsnorm, rotary  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor, kc: KernelConfig) -> bool:
    """Whether to call a Triton kernel on ``x``: CUDA tensors, kernels importable, not off."""
    return x.is_cuda and kc.triton_kernels and _kernels_ok()
