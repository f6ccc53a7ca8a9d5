"""Weight prefetch into the L2 cache, for decode steps of a few tokens (Hopper and later).

At batch 1 a decode step streams every weight once through GEMVs, and between the GEMVs run
kernels that barely touch memory (norms, rotary, the KV write, attention over one sequence): for
those microseconds HBM idles. A prefetch kernel launched before such a stretch asks the memory
system to pull (the start of) the next weight into L2 -- ``cp.async.bulk.prefetch.L2``, a
fire-and-forget bulk request that uses neither registers nor shared memory -- so the GEMV that
follows finds part of its weight in L2 instead of waiting on HBM::

    qkv GEMV | prefetch(o_proj) | rotary | KV write | attention | o_proj GEMV (hits L2) | ...
                       \\________ HBM streams o_proj here ________/

A prefetch is a hint: it never changes a result, only when bytes arrive. The kernel lets the next
kernel launch at once, issues its requests, then waits for the kernel before it (PDL), so every
kernel after it still sees all writes before it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LANES = 128  # requests per program (one per thread of 4 warps)
CHUNK = 16384  # bytes per request
launches = 0  # kernels launched (or captured) so far, for tests


@triton.jit
def _prefetch_kernel(addr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    if PDL:
        gdc_wait()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(t: torch.Tensor) -> bool:
    """Whether a prefetch of ``t`` can be issued (a CUDA tensor on Hopper or later)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _supported(index)


def prefetch(t: torch.Tensor, nbytes: int | None = None, chunk: int = CHUNK) -> None:
    """Ask for the first ``nbytes`` (default: all) of contiguous ``t`` to be pulled into L2."""
    from fulcrum.kernels import pdl

    total = t.numel() * t.element_size()
    n = total if nbytes is None else min(nbytes, total)
    n -= n % 16  # bulk requests are whole 16-byte units
    if n <= 0:
        return
    global launches
    launches += 1
    programs = triton.cdiv(triton.cdiv(n, chunk), LANES)
    m = pdl.mode(t, programs)
    _prefetch_kernel[(programs,)](
        t.data_ptr(),
        n,
        CHUNK=chunk,
        LANES=LANES,
        PDL=m != pdl.OFF,
        num_warps=4,
        **pdl.launch_options(m),
    )
