"""``out[idx[0, i]] = src[idx[1, i]]`` in one launch (torch needs a gather and a scatter).

A decode step's input ids include the tokens the previous step sampled, which are still on the
device: the runner copies the row pairs with the step's other inputs and fills them here, as
the decode graph's first kernel (``worker/cuda_graph.py``) or right before the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


# One compiled variant whatever the step: the row count, the stride and the buffers' alignment
# (slices of a staging buffer) vary between steps and would otherwise each compile their own.
@triton.jit(do_not_specialize=["out_ptr", "src_ptr", "idx_ptr", "n", "stride_idx"])
def _gather_scatter_kernel(out_ptr, src_ptr, idx_ptr, n, stride_idx, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = tl.load(idx_ptr + i, mask=i < n, other=-1)
    mask = dst >= 0
    row = tl.load(idx_ptr + stride_idx + i, mask=mask, other=0)
    tl.store(out_ptr + dst, tl.load(src_ptr + row, mask=mask), mask=mask)


def gather_scatter(out: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``out[idx[0]] = src[idx[1]]`` for 1-D ``out``/``src`` and int64 ``idx [2, n]``; a
    column whose ``idx[0]`` is negative is skipped (a fixed-width patch in a CUDA graph)."""
    n = idx.shape[1]
    if n == 0:
        return
    assert out.dim() == 1 and src.dim() == 1 and idx.stride(1) == 1
    grid = (triton.cdiv(n, BLOCK),)
    _gather_scatter_kernel[grid](out, src, idx, n, idx.stride(0), BLOCK=BLOCK, num_warps=4)
