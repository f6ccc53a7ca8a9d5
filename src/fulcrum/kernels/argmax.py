"""Greedy token ids of a few logits rows: ``logits.argmax(-1)`` in one launch.

A batch-1 decode step ends with the argmax of one 128k-wide row. torch reduces it in two
kernels (a per-chunk max, then the argmax of the chunk maxima, plus the index arithmetic):
~25 us of a ~4 ms step on an H200, for 256 KB that the LM head has just written to L2. Here one
program per row walks the row ``CHUNK`` values at a time (a chunk's loads all in flight at
once) and keeps the first maximum::

    best = -inf, at 0
    for each chunk c (in order):  m, i = max and first argmax of logits[row, c]
                                  if m > best: best, at = m, c.start + i   (strictly greater:
                                                                            ties keep the
                                                                            earliest index)

NaN counts as +inf (torch ranks NaN above every number). Launched with PDL, it waits for the
LM head's kernel like the rest of the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl

# The greedy sampler uses this kernel on CUDA for up to MAX_ROWS rows (more: torch's argmax,
# which spreads a large batch over the device), where ``KernelConfig.argmax_kernel`` is on.
# Measured neutral on an H200's device time at batch 1: it is kept for the three launches it
# saves the host.
MAX_ROWS = 32
CHUNK, WARPS = 16384, 16  # 32 values a thread per chunk
INTERPRET_CHUNK = 1024


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, stride_x, V, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, CHUNK)
    best = float("-inf")
    at = 0
    for c0 in range(0, V, CHUNK):
        x = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = m > best
        best = tl.where(take, m, best)
        at = tl.where(take, c0 + i, at)
    tl.store(out_ptr + row, at.to(tl.int64))


def argmax_rows(
    logits: torch.Tensor, out: torch.Tensor | None = None, pdl_cfg: PdlConfig = pdl.DEFAULT
) -> torch.Tensor:
    """``logits.argmax(-1)`` (first maximum on ties) for ``logits [n, V]``, ``n <= MAX_ROWS``;
    into ``out`` (int64 ``[n]``, contiguous) when given."""
    n, vocab = logits.shape
    if n > MAX_ROWS or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows: logits {tuple(logits.shape)}, at most {MAX_ROWS} rows")
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    assert out.shape == (n,) and out.dtype == torch.int64 and out.stride(0) == 1
    if n == 0:
        return out
    chunk = CHUNK if logits.is_cuda else INTERPRET_CHUNK
    chunk = min(chunk, triton.next_power_of_2(vocab))
    m = pdl.mode(logits, n, pdl_cfg)
    _argmax_kernel[(n,)](
        logits,
        out,
        logits.stride(0),
        vocab,
        CHUNK=chunk,
        PDL=m,
        num_warps=WARPS if logits.is_cuda else 1,
        **pdl.launch_options(m),
    )
    return out
