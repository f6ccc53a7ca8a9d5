"""W4A16 GEMV and GEMM (``kernels/w4a16.py``) at Llama-3.1-8B and Llama-3.3-70B linear-layer
shapes (INT4, group 128), against cuBLAS bf16 on the same shape and the INT4 bandwidth floor:
a CUDA graph of one linear per weight copy, over enough copies (>= 2 GB) that every weight
comes from HBM, not L2. Reports µs per linear, the floor (packed words + scales + zeros at
4.28 TB/s) and the max relative error against dequantize-then-matmul.

    python benchmarks/w4a16_bench.py [--m 1 4 16 64 256 1024] [--shapes qkv down ...]
        [--gemv-configs 32,256,4 ...] [--gemv1-configs 256,64,1 ...] [--gemm-configs ...]

``gemv`` is the kernel that dequantizes each weight (any few rows), ``gemv1`` the one-row kernel
that takes each group's scale and zero out of its sums (what one row runs by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "70b_qkv": (10240, 8192),
    "70b_gate_up": (57344, 8192),
    "70b_down": (8192, 28672),
}
GROUP = 128
GEMV_CONFIGS = ["32,256,4", "16,512,4", "64,128,4", "32,512,8", "16,256,2"]
# the one-row kernel (m = 1): block_n, block_k, num_warps[, split_k]
GEMV1_CONFIGS = ["256,64,1", "128,64,1", "512,32,1", "256,32,1", "128,128,1", "512,64,2"]
GEMM_CONFIGS = ["64,128,64,4", "128,128,64,8", "32,64,128,4", "16,64,128,4"]


def bench_shape(name: str, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from fulcrum.kernels import w4a16, w4a16_common, w4a16_gemv

    dev, dt = "cuda", torch.bfloat16
    n, k = SHAPES[name]
    groups = k // GROUP
    nbytes = n * k // 2 + groups * n * 3  # words + fp16 scales + byte zeros
    copies = max(2, -(-2_000_000_000 // nbytes))
    gen = torch.Generator(device=dev).manual_seed(0)
    qws = [
        torch.randint(
            -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev, generator=gen
        )
        for _ in range(copies)
    ]
    zeros = torch.full((groups, n), 8, dtype=torch.uint8, device=dev)
    scales = (torch.rand(groups, n, device=dev, generator=gen) * 0.004).half()
    bf16 = torch.randn(n, k, device=dev, dtype=dt) * 0.02  # one copy: cuBLAS timed apart below
    bf16_copies = max(2, -(-2_000_000_000 // (n * k * 2)))
    bfs = [bf16] + [torch.empty_like(bf16).copy_(bf16) for _ in range(bf16_copies - 1)]

    def kernel(fn, cfg, **kw):
        return lambda x, i: fn(x, qws[i], zeros, scales, None, GROUP, 4, cfg, **kw)

    for m in args.m:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ref = w4a16_common.reference_matmul(x, qws[0], zeros, scales, None, GROUP, 4).float()
        row = {"shape": name, "n": n, "k": k, "m": m, "group": GROUP}
        row["floor_us"] = round(nbytes / 4.28e12 * 1e6, 2)
        row["bf16_floor_us"] = round(n * k * 2 / 4.28e12 * 1e6, 2)
        variants = {}
        if m <= 16:
            for c in args.gemv_configs:
                cfg = tuple(map(int, c.split(",")))
                variants[f"gemv {c}"] = (kernel(w4a16_gemv.gemv, cfg, one_row=False), copies)
        if m == 1:
            for c in args.gemv1_configs:
                cfg = tuple(map(int, c.split(",")))
                variants[f"gemv1 {c}"] = (kernel(w4a16_gemv.gemv, cfg, one_row=True), copies)
        for c in args.gemm_configs:
            variants[f"gemm {c}"] = (kernel(w4a16.gemm, tuple(map(int, c.split(",")))), copies)
        for c in args.gemm_t_configs:
            cfg = tuple(map(int, c.split(",")))
            variants[f"gemmT {c}"] = (kernel(w4a16.gemm, cfg, swap_ab=True), copies)
        if args.dense:
            variants["dense"] = (
                lambda x, i: w4a16.dense_linear(x, qws[i], zeros, scales, None, GROUP, 4), copies
            )
        variants["cublas bf16"] = (lambda x, i: F.linear(x, bfs[i]), bf16_copies)
        time_variants(row, variants, x, ref, args.rounds)
        print("RESULT " + json.dumps(row), flush=True)


def time_variants(row: dict, variants: dict, x, ref, rounds: int, exact=("cublas",)) -> None:
    """``row[name]``: µs per call of each ``variants[name] = (lin(x, copy), copies)``, timed as
    a CUDA graph over its copies; ``row[name + " err"]`` where it is off ``ref`` by > 2e-2
    (names starting with ``exact`` are not checked)."""
    for vname, (lin, count) in variants.items():
        try:
            y = lin(x, 0).float()
            if not vname.startswith(exact):
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    row[vname + " err"] = err

            def chain(lin=lin, count=count, x=x):
                def run() -> None:
                    for i in range(count):
                        lin(x, i)

                return run

            graph = g.capture_graph(chain())
            t = [g.replay_ms(graph, 1) for _ in range(rounds)]
            row[vname] = round(statistics.median(t) * 1e3 / count, 2)
            del graph
        except Exception as e:  # noqa: BLE001  (a config that does not compile)
            row[vname] = repr(e)[:100]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--gemv-configs", nargs="+", default=GEMV_CONFIGS)
    ap.add_argument("--gemm-configs", nargs="+", default=GEMM_CONFIGS)
    ap.add_argument(
        "--gemv1-configs", nargs="+", default=GEMV1_CONFIGS,
        help="the one-row GEMV's configs at m = 1 (block_n,block_k,num_warps[,split_k])",
    )
    ap.add_argument(
        "--gemm-t-configs", nargs="+", default=[],
        help="configs of the GEMM with swapped operands (swap_ab: the weight as the MMA's A)",
    )
    ap.add_argument("--dense", action="store_true", help="also dequantize + cuBLAS")
    ap.add_argument("--rounds", type=int, default=5, help="timed replays (median)")
    args = ap.parse_args()
    import torch

    for name in args.shapes:
        bench_shape(name, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
