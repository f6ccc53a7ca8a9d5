"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and later GPUs.

Between two kernels on a stream the GPU normally drains the first, then launches the second. A
kernel launched with PDL may be launched while the one before it is still running; it waits for it
(``griddepcontrol.wait``: returns once that grid has finished and its writes are visible) before
touching memory. A batch-1 decode step runs ~450 kernels, so the launch gaps add up. A kernel
whose whole grid is resident at once also signals ``griddepcontrol.launch_dependents`` before
its wait (or right after it), letting the next PDL kernel launch during its run; a larger grid
does not (waiting programs of the next kernel would hold multiprocessors its later programs
need), except the batch-1 GEMV and the small-batch decode split grid (resident at once),
measured faster releasing early::

    mode OFF    plain launch, no wait compiled in (CPU, interpreter, pre-Hopper, PDL disabled)
    mode WAIT   launch with PDL; wait first
    mode EARLY  launch with PDL; wait first, then let dependents launch
    mode PRE    launch with PDL; let dependents launch, then wait (``pre_release``: small grids,
                and the batch-1 GEMV whatever its size, ``mode(..., early=True)``)

Where a kernel releases its dependents never changes what they see: ``griddepcontrol.wait``
waits for the whole grid before it to finish, whenever that grid let it launch. It changes only
when the dependents' programs start (the GEMV's first weight tile is read before its wait) and
which multiprocessors they hold meanwhile. A grid launches only once every program of the grid
before it has released or exited, so every program of that grid is resident by then: a waiting
dependent never keeps an earlier kernel's program from running.

Every kernel launched with PDL waits before its first write and before reading anything a kernel
writes, so each kernel still sees all writes of every kernel before it (the kernel it waits for
waited in turn), and never overwrites memory a kernel before it still reads. Reads before the
wait touch only what no kernel writes during a step: weights (the GEMV's first tile, the norm's
weight) and the step's inputs, copied from the host before its first kernel (decode
attention's request rows, lengths and block tables). A PDL kernel launches only after every
kernel before it has launched, and one without PDL (a copy, cuBLAS, torch) only after the work
before it is done. Kernels outside fulcrum (cuBLAS, torch) keep their plain launches; a PDL
kernel after one of them waits for it just the same.

Whether and how to use PDL is the engine's ``KernelConfig.pdl`` (``PdlConfig``), passed to each
kernel wrapper; a direct call without one takes ``DEFAULT``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fulcrum.config import PdlConfig

OFF, WAIT, EARLY, PRE = 0, 1, 2, 3
# The policy of a launch whose caller passes none (tests, benchmarks calling a kernel directly).
# Releasing before the wait (PRE) rather than after it measured faster on an H200 at batch 1,
# with the GEMV's grids released early too.
DEFAULT = PdlConfig()


@functools.cache
def _device(index: int) -> tuple[bool, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major >= 9, props.multi_processor_count


def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (grids are sized against it)."""
    return _device(index)[1]


def mode(t: torch.Tensor, programs: int, cfg: PdlConfig = DEFAULT, early: bool = False) -> int:
    """The PDL mode of a launch of ``programs`` programs on ``t``'s device under ``cfg``;
    ``early``: release the next kernel early whatever the grid's size (the batch-1 GEMV: every
    program of a grid has started once it releases, and a GEMV's tail is where the next
    kernel's launch hides)."""
    if not (cfg.enabled and t.is_cuda):
        return OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    hopper, sms = _device(index)
    if not hopper:
        return OFF
    if early or programs <= sms * cfg.early_max_waves:
        return PRE if cfg.pre_release else EARLY
    return WAIT


def launch_options(m: int) -> dict[str, bool]:
    """Keyword arguments for the kernel launch in mode ``m``."""
    return {"launch_pdl": True} if m != OFF else {}


@triton.jit
def wait(MODE: tl.constexpr):
    """First statement of a kernel: wait for the kernel before it (and release the next)."""
    if MODE == 3:
        gdc_launch_dependents()
    if MODE != 0:
        gdc_wait()
    if MODE == 2:
        gdc_launch_dependents()
