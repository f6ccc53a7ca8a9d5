"""End-to-end A/B on one machine, each variant in its own process, same workloads as
``gpu_h200.py`` (TTFT, 128/128 x 1,000, 1,000/1,000 x 1,000):

    new       the engine as it is
    base      decode programs in request order (not longest context first)
    cublaslt  the engine with torch's cuBLASLt preferred for the GEMMs

    python benchmarks/throughput_ab.py [--order new,base,cublaslt] [--skip-long]

Prints one RESULT line per measurement with its ``variant``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402


def variant(name: str, long: bool) -> None:
    if name == "base":
        import fulcrum.attention.triton_backend as tb

        tb.ORDER_MIN_REQS = 10**9
    if name == "cublaslt":
        import torch

        torch.backends.cuda.preferred_blas_library("cublaslt")
    from fulcrum import LLM

    llm = LLM(g.MODEL, **g.ENGINE)
    drv = g.Driver(llm)
    t_end = time.perf_counter() + 1e9
    drv.run(g.workload(8, 300, 16, 99), t_end)  # warm-up
    g.bench_prefill(drv, t_end)
    g.bench_itl(drv, t_end)
    plan = [("128/128", 1000, 128, 128)] + ([("1000/1000", 1000, 1000, 1000)] if long else [])
    for wl, n, n_in, n_out in plan:
        r = drv.run(g.workload(n, n_in, n_out, 7), t_end)
        g.emit("throughput", variant=name, workload=wl, **r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", default="new,base", help="variants to run, in this order")
    ap.add_argument("--skip-long", action="store_true", help="leave out 1,000/1,000")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return variant(args.variant, not args.skip_long)
    for name in args.order.split(","):
        cmd = [sys.executable, __file__, "--variant", name] + (
            ["--skip-long"] if args.skip_long else []
        )
        print(f"== {name}", flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
