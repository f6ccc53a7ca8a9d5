"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU.

Inside ``compile_for_hopper()`` every kernel launch compiles for an H100/H200 (Triton's own
ptxas, down to the cubin) and launches nothing: the production launch code runs on CPU tensors,
so each kernel is built with the exact arguments, block sizes, warps and stages the engine would
give it. The interpreter runs code that the compiler rejects, and a tile that does not fit
shared memory fails only at launch on the device; this finds both here. Outputs are left
unwritten. Run it in a process without ``TRITON_INTERPRET=1`` (``run_in_subprocess``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# Dynamic shared memory a block may opt into on sm_90 (227 KiB).
HOPPER_MAX_SHARED = 232_448


@dataclass
class Compiled:
    name: str
    shared: int  # bytes of shared memory per block
    num_warps: int
    num_stages: int


class _HopperDriver:
    """What ``JITFunction.run`` and ``triton.compile`` ask of the active driver."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compile_for_hopper() -> Iterator[list[Compiled]]:
    """Launches inside compile for sm_90 instead of running; yields the list of what was
    built (filled as kernels compile)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    assert os.environ.get("TRITON_INTERPRET") != "1", "the interpreter would run the kernels"
    built: list[Compiled] = []
    real_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        md = kernel.metadata
        built.append(Compiled(self.fn.__name__, md.shared, md.num_warps, md.num_stages))
        return kernel

    driver.set_active(_HopperDriver())
    JITFunction.run = run
    try:
        yield built
    finally:
        JITFunction.run = real_run
        driver.reset_active() if driver._default is not None else driver.set_active(None)


def check_fits(built: list[Compiled]) -> None:
    """Every kernel built, and each one's shared memory within what sm_90 gives a block."""
    assert built, "nothing was compiled"
    for c in built:
        assert c.shared <= HOPPER_MAX_SHARED, (
            f"{c}: over {HOPPER_MAX_SHARED} bytes of shared memory"
        )


def run_in_subprocess(code: str, timeout: float = 600) -> str:
    """Run ``code`` in a fresh interpreter without ``TRITON_INTERPRET``; its stdout, or an
    assertion error with its stderr's tail."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [here, os.path.join(here, "..", "src"), env.get("PYTHONPATH", "")]
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
