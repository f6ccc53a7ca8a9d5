"""Small-batch linear layers on CUDA: cuBLAS against the fused Triton GEMV, at Llama-3.1-8B shapes.

Each figure is one CUDA-graph replay over enough distinct weight copies (>= 2 GB) that nothing is
served from L2, divided by the copies: what a decode step sees, launch gaps included.
TB/s = weight bytes / time, against the device's copy bandwidth (H200: ~4.28 TB/s).

    PYTHONPATH=src python benchmarks/gemv_bench.py [--m 1 4 16] [--configs 32,256,4,4 16,512,4,3]
    PYTHONPATH=src python benchmarks/gemv_bench.py --chain     (32 layers: unfused vs fused ops)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from fulcrum.kernels import gemv as gemv_mod
from fulcrum.kernels.activation import silu_and_mul
from fulcrum.kernels.gemv import ADD_NORM, NONE, SILU, gemv
from fulcrum.kernels.rmsnorm import fused_add_rms_norm

HIDDEN, INTER, QKV, VOCAB = 4096, 14336, 6144, 128256
SHAPES = {  # name: (N, K)
    "qkv": (QKV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of ``fn`` captured once in a CUDA graph (median of ``reps`` replays)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def bench_shapes(ms: list[int], configs: list[tuple[int, int, int, int]]) -> None:
    dt = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, math.ceil(2e9 / nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            t = graph_time(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]) / copies
            row = [f"{name:8s} M={m:<2d} cuBLAS {t * 1e6:6.1f} us {nbytes / t / 1e12:5.2f} TB/s"]
            best = None
            for cfg in configs:
                gemv_mod.GPU_CONFIG[f"{n}x{k}"] = cfg
                t = graph_time(lambda x=x, ws=ws: [gemv(x, w) for w in ws]) / copies
                if best is None or t < best[0]:
                    best = (t, cfg)
                row.append(f"{cfg}: {t * 1e6:6.1f} us {nbytes / t / 1e12:5.2f}")
            gemv_mod.GPU_CONFIG.pop(f"{n}x{k}", None)
            print(" | ".join(row), f"| best {best[1]}", flush=True)
        ws.clear()
        torch.cuda.empty_cache()


def bench_chain(m: int, layers: int = 32) -> None:
    """The linear part of ``layers`` decoder layers, without attention: norm+qkv, o_proj,
    norm+gate_up, silu+down -- unfused (Triton norm/SiLU kernels + cuBLAS) vs fused GEMV."""
    dt = torch.bfloat16
    mk = lambda n, k: torch.randn(n, k, device="cuda", dtype=dt) / k**0.5  # noqa: E731
    ws = [
        (mk(QKV, HIDDEN), mk(HIDDEN, HIDDEN), mk(2 * INTER, HIDDEN), mk(HIDDEN, INTER))
        for _ in range(layers)
    ]
    nw = torch.ones(HIDDEN, device="cuda", dtype=dt)
    x0 = torch.randn(m, HIDDEN, device="cuda", dtype=dt)
    r0 = torch.randn(m, HIDDEN, device="cuda", dtype=dt)
    nbytes = sum(w.numel() * 2 for layer in ws for w in layer)

    def unfused():
        x, r = x0, r0
        for wqkv, wo, wgu, wd in ws:
            h, r = fused_add_rms_norm(x, r, nw, 1e-5)
            qkv = F.linear(h, wqkv)
            a = F.linear(qkv[:, :HIDDEN], wo)
            h, r = fused_add_rms_norm(a, r, nw, 1e-5)
            x = F.linear(silu_and_mul(F.linear(h, wgu)), wd)

    def fused():
        x, r = x0, r0
        for wqkv, wo, wgu, wd in ws:
            qkv, r = gemv(x, wqkv, prologue=ADD_NORM, residual=r, norm_weight=nw, eps=1e-5)
            a, _ = gemv(qkv[:, :HIDDEN], wo, prologue=NONE)
            gu, r = gemv(a, wgu, prologue=ADD_NORM, residual=r, norm_weight=nw, eps=1e-5)
            x, _ = gemv(gu, wd, prologue=SILU)

    for name, fn in (("unfused", unfused), ("fused", fused)):
        t = graph_time(fn)
        print(
            f"chain M={m} {layers} layers {name:8s} {t * 1e3:6.3f} ms  "
            f"{nbytes / t / 1e12:5.2f} TB/s of weights  (floor {nbytes / 4.28e12 * 1e3:.3f} ms)",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16], help="rows (batch sizes)")
    p.add_argument(
        "--configs",
        nargs="*",
        default=["32,256,4,4"],
        help="Triton launch configs to sweep, each block_n,block_k,num_warps,num_stages",
    )
    p.add_argument("--chain", action="store_true", help="also time 32 layers unfused vs fused")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    bench_shapes(args.m, configs)
    if args.chain:
        for m in args.m:
            bench_chain(m)


if __name__ == "__main__":
    main()
