"""Weight prefetch into L2 ahead of the GEMVs of decode steps of a few tokens.

The decoder asks for the next weight just before each stretch of kernels that leave HBM idle
(``kernels/l2_prefetch.py``): the o_proj weight before rotary, the KV write and attention; the
start of gate_up before the post-attention norm, of down before SiLU-and-multiply, of the next
qkv before the input norm. A step of more than ``MAX_TOKENS`` tokens streams its weights at full
bandwidth already (or is compute-bound), so it gets none; so does an eager step, where each
launch costs the host tens of microseconds, more than the prefetch saves: the requests are
issued only inside CUDA-graph captures (the decode graphs, piecewise prefill graphs).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fulcrum.model.layers.dispatch import use_triton

ENABLED = os.environ.get("FULCRUM_L2_PREFETCH", "1") != "0"  # read at each call (and capture)
MAX_TOKENS = 8
MB = 1 << 20
# Bytes asked for per weight: what HBM can deliver in the idle stretch before its GEMV,
# within L2 (50 MB on an H100/H200).
BUDGET = {"o_proj": 40 * MB, "gate_up": 16 * MB, "down": 16 * MB, "qkv": 16 * MB}


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def prefetch_weight(layer: nn.Linear, x: torch.Tensor, name: str) -> None:
    """Prefetch (the start of) ``layer``'s weight if ``x`` is a small batch being captured."""
    if not (ENABLED and x.shape[0] <= MAX_TOKENS and BUDGET.get(name) and use_triton(x)):
        return
    from fulcrum.kernels import l2_prefetch

    if l2_prefetch.supported(x) and _capturing():
        l2_prefetch.prefetch(layer.weight, BUDGET[name])
