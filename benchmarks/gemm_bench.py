"""The weight GEMMs of a Llama-3.1-8B step on CUDA, per BLAS library, against 790 TFLOP/s.

A decode step at batch 384 and a mixed step of ~8.6k tokens are compute-bound: their time is the
GEMM FLOPs over the tensor-core rate. Each figure is one CUDA-graph replay over several weight
copies (so L2 holds none of them), divided by the copies.

    PYTHONPATH=src python benchmarks/gemm_bench.py [--m 384 8576] [--blas cublas cublaslt]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402

HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 14336, 6144, 128256, 32
SHAPES = {  # name: (N, K, calls per step)
    "qkv": (QKV, HIDDEN, LAYERS),
    "o_proj": (HIDDEN, HIDDEN, LAYERS),
    "gate_up": (2 * INTER, HIDDEN, LAYERS),
    "down": (HIDDEN, INTER, LAYERS),
    "lm_head": (VOCAB, HIDDEN, 1),
}
PEAK = 790e12


def graph_time(fn, reps: int = 10) -> float:
    """Seconds per call of ``fn`` captured once in a CUDA graph (mean of ``reps`` replays)."""
    return g.replay_ms(g.capture_graph(fn), reps) / 1e3


def step_gemms(m: int, weight: Callable[[int, int], torch.Tensor]) -> tuple[Callable, float]:
    """One step's weight GEMMs at ``m`` rows, in a step's order (a layer's four, 32 times, then
    the LM head), one weight per shape made by ``weight(n, k)``: the function and its FLOPs."""
    layer, head, flops = [], [], 0.0
    for n, k, calls in SHAPES.values():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        (layer if calls == LAYERS else head).append((x, weight(n, k).t(), y))
        flops += 2 * m * n * k * calls
    ops = layer * LAYERS + head
    return lambda: [torch.mm(x, wt, out=y) for x, wt, y in ops], flops


def sustained(m: int, lib: str, seconds: float) -> None:
    """One step's GEMMs replayed for ``seconds``: the rate a long run of compute-bound steps
    holds, and the SM clock and power it holds it at (a step at the power cap runs below the
    clock the peak assumes)."""
    torch.backends.cuda.preferred_blas_library(lib)
    fn, flops = step_gemms(
        m, lambda n, k: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    )
    graph = g.capture_graph(fn)
    step_ms = g.replay_ms(graph, 2)
    reps = max(3, int(seconds * 1e3 / step_ms))
    first = g.replay_ms(graph, 3)
    t = g.replay_ms(graph, reps) / 1e3
    mhz_w = g.clock_power()
    print(
        f"M={m:<5d} sustained {lib} {reps} steps ({reps * t:.1f} s): {t * 1e3:7.2f} ms per step "
        f"({first:.2f} ms fresh), {flops / t / PEAK:5.1%} of peak; SM MHz, W at the end: {mhz_w}",
        flush=True,
    )
    del graph, fn
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[384, 8576], help="rows (tokens per step)")
    p.add_argument("--blas", nargs="+", default=["cublas", "cublaslt"], help="BLAS libraries")
    p.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        help="also replay each M's whole step of GEMMs (first BLAS) back to back for this many "
        "seconds and report the rate with NVML's SM clock and power at the end (0: skip)",
    )
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  bf16  peak {PEAK / 1e12:.0f} TFLOP/s")
    dt = torch.bfloat16
    for m in args.m:
        totals = dict.fromkeys(args.blas, 0.0)
        flops_total = 0.0
        for name, (n, k, calls) in SHAPES.items():
            copies = max(2, math.ceil(1e9 / (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=dt)
            flops = 2 * m * n * k
            flops_total += flops * calls
            row = [f"M={m:<5d} {name:8s}"]
            for lib in args.blas:
                torch.backends.cuda.preferred_blas_library(lib)
                t = graph_time(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]) / copies
                totals[lib] += t * calls
                row.append(f"{lib} {t * 1e6:8.1f} us {flops / t / PEAK:5.1%}")
            print(" | ".join(row), flush=True)
            ws.clear()
            torch.cuda.empty_cache()
        if args.sustain > 0:
            sustained(m, args.blas[0], args.sustain)
        for lib, t in totals.items():
            print(
                f"M={m:<5d} step total {lib}: {t * 1e3:7.2f} ms  {flops_total / t / PEAK:5.1%} "
                f"of peak (floor {flops_total / PEAK * 1e3:.2f} ms)",
                flush=True,
            )
    torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
