"""A oneDNN-packed copy of a float32 linear layer's weight, for few-row steps on the CPU.

A verify step (speculative decoding) multiplies k + 1 rows per request by every weight. With
``F.linear`` (MKL) on the ``[out, in]`` weight, a step of four rows or more costs far more than
a one-row step: a 5-row forward of SmolLM2-135M took ~1.7x a one-row forward. oneDNN's linear on
a weight packed once into its blocked layout takes about the same time for 2 to 9 rows, close to
MKL's one-row GEMV, and no longer than MKL for a 64- or 256-row chunk. One-row steps keep MKL,
faster than oneDNN there, so the packed copy sits beside the original weight: the weights'
memory doubles, hence only with speculation on.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 64  # larger steps (prefill chunks) keep MKL: no faster packed, and unchanged


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight as :func:`pack_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a float32 CPU weight ``[out, in]``; None where oneDNN is
    missing or the weight is of another dtype or device."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, NotImplementedError) as e:  # a build without this op
        logger.info("No oneDNN-packed linear weights: %s", e)
        return None


def pack_linear_weights(model: nn.Module, layer_cls: type[nn.Module]) -> int:
    """Give every ``layer_cls`` layer of ``model`` with a float32 CPU weight its packed copy
    (the layer's ``packed`` attribute, which its forward takes for 2 to ``PACKED_MAX_ROWS``
    rows). Returns how many layers got one."""
    n = 0
    for m in model.modules():
        if isinstance(m, layer_cls):
            packed = pack_weight(m.weight)
            if packed is None:
                continue
            m.packed = packed
            n += 1
    return n
