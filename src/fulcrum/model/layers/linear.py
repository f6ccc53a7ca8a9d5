"""``nn.Linear`` whose few-row calls on CUDA run the Triton GEMV (``kernels/gemv.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import GEMV_MAX_M
from fulcrum.model.layers.dispatch import use_triton


class Linear(nn.Linear):
    """A decode step of up to ``gemv.USE_MAX_M`` requests (read at each call, so a benchmark
    may switch it; see ``gemv.use_gemv``) runs the GEMV, measured faster than cuBLAS on every
    linear layer of an 8B model at batch 1; anything larger runs the BLAS GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the row count first: a prefill step pays one comparison per layer, not the dispatch
        if x.shape[0] <= GEMV_MAX_M and x.dim() == 2 and use_triton(x):
            from fulcrum.kernels import gemv

            if gemv.use_gemv(x, self.weight):
                return gemv.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
