"""Triton kernels compiled in parallel, ahead of the start-up passes that first launch them.

With an empty Triton cache, most of a cold start is compiling: KV profiling and decode-graph
capture each launch a dozen kernel variants for the first time, and each launch compiles its
variant before it runs, one after another. ``compile_ahead(fn)`` runs ``fn`` once as a dry
pass in which every Triton launch only hands its variant to a thread pool
(``triton.AsyncCompileMode``; compiling releases the GIL for most of its time, and ptxas is a
process of its own) and returns without running; torch operations run as usual on whatever the
skipped kernels left in memory. Once every compile has finished, each variant's host launcher
(a small C module Triton builds with the C compiler) is built in the same pool, and the real
pass finds both ready.

Only use it on passes whose Python does not depend on tensor values (no host syncs, no indices
computed by a Triton kernel): the dry pass's tensors hold garbage. Any error in the dry pass is
logged and ignored -- the real pass then compiles as it always did. The price, paid even when
the cache is warm, is the dry pass's torch work: one profiling forward and a decode step per
dry-run bucket (``DecodeGraphs._warm_up`` runs 14 of the 43). ``KernelConfig.compile_ahead``
turns it off (callers pass it as ``enabled``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

MAX_WORKERS = 16


def compile_ahead(fn: Callable[[], object], what: str, enabled: bool = True) -> int | None:
    """Compile the Triton variants ``fn`` launches, in parallel, without running them; returns
    how many were compiled (None: not attempted -- ``enabled`` off, no CUDA, one CPU -- or
    failed and skipped)."""
    workers = min(MAX_WORKERS, os.cpu_count() or 1)
    if not enabled or workers < 2 or not torch.cuda.is_available():
        return None
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
            with triton.AsyncCompileMode(pool, ignore_errors=True) as mode:
                JITFunction.run = compile_only
                try:
                    fn()
                finally:
                    JITFunction.run = run
            kernels = [fk.kernel for fk in mode.future_kernels.values() if fk.kernel is not None]
            _build_launchers(pool, kernels)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (an optimisation: the real pass compiles anyway)
        JITFunction.run = run
        logger.warning("Compiling ahead of %s failed (%s); compiling as kernels launch.", what, e)
        return None
    n = len(mode.future_kernels)
    if n:
        logger.info(
            "Compiled %d Triton kernel variants ahead of %s in %.2f s (%d threads)",
            n,
            what,
            time.perf_counter() - t0,
            workers,
        )
    return n


def _build_launchers(pool: ThreadPoolExecutor, kernels: list) -> None:
    """Build the host launcher of each compiled variant in ``pool``. Triton builds a variant's
    launcher (a C module, compiled by the host's C compiler: ~0.3 s each) at its first launch,
    on the launching thread, one after another; built here, the modules land in Triton's cache
    where those first launches load them."""
    if not kernels:
        return
    from triton.runtime import driver

    launcher = driver.active.launcher_cls
    for f in [pool.submit(launcher, k.src, k.metadata) for k in kernels]:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001  (the first launch builds it as before)
            logger.debug("Building a Triton launcher ahead failed: %s", e)
