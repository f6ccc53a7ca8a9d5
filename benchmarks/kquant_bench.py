"""GGUF K-quant GEMV and GEMM (``kernels/kquant.py``: Q4_K, Q5_K, Q6_K) at Llama-3.1-8B and
Llama-3.3-70B linear-layer shapes, against cuBLAS bf16 on the same shape, the INT4 W4A16 kernels
(``w4a16.py``, group 128) and each type's bandwidth floor: a CUDA graph of one linear per weight
copy, over enough copies (>= 2 GB) that every weight comes from HBM, not L2. Reports µs per
linear, the floor (the packed layout's bytes at 4.28 TB/s) and the max relative error against
dequantize-then-matmul where it exceeds 2e-2.

    python benchmarks/kquant_bench.py [--types Q4_K Q5_K Q6_K] [--m 1 4 16 64 256 1024]
        [--shapes qkv down ...] [--gemv-configs 32,256,4[,split_k] ...] [--gemm-configs 64,128,64,4 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4a16_bench import SHAPES, time_variants  # noqa: E402

GEMV_CONFIGS = [  # (block_n, block_k, warps[, split_k])
    "32,128,4", "32,256,8", "16,256,4", "64,128,8", "16,128,2",
    "32,128,4,2", "32,128,4,4", "64,128,4,4", "32,128,4,8",
]  # fmt: skip
GEMM_CONFIGS = ["64,128,64,4", "128,128,64,8", "32,64,128,4", "16,64,128,4", "64,64,256,4"]


def bench_shape(name: str, qtype: str, args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from fulcrum.kernels import kquant, w4a16, w4a16_gemv

    dev, dt = "cuda", torch.bfloat16
    n, k = SHAPES[name]
    gen = torch.Generator(device=dev).manual_seed(0)
    w0 = kquant.random_packed(qtype, n, k, gen, dev)
    nbytes = sum(t.numel() * t.element_size() for t in w0[1:] if t is not None)
    copies = max(2, -(-2_000_000_000 // nbytes))
    ws = [w0] + [kquant.random_packed(qtype, n, k, gen, dev) for _ in range(copies - 1)]
    int4 = (k // 8 * n * 4 + k // 128 * n * 3, max(2, -(-2_000_000_000 // (k * n // 2))))
    qws = [torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev,
                         generator=gen) for _ in range(int4[1])]  # fmt: skip
    zeros = torch.full((k // 128, n), 8, dtype=torch.uint8, device=dev)
    scales = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.004).half()
    bf16 = torch.randn(n, k, device=dev, dtype=dt) * 0.02
    bf16_copies = max(2, -(-2_000_000_000 // (n * k * 2)))
    bfs = [bf16] + [torch.empty_like(bf16).copy_(bf16) for _ in range(bf16_copies - 1)]

    def kernel(fn, cfg):
        return lambda x, i: fn(x, ws[i], None, cfg)

    for m in args.m:
        x = torch.randn(m, k, device=dev, dtype=dt)
        ref = kquant.reference_matmul(x, w0, None).float()
        row = {"type": qtype, "shape": name, "n": n, "k": k, "m": m}
        row["bits_per_weight"] = round(nbytes * 8 / (n * k), 3)
        row["floor_us"] = round(nbytes / 4.28e12 * 1e6, 2)
        row["int4_g128_floor_us"] = round(int4[0] / 4.28e12 * 1e6, 2)
        row["bf16_floor_us"] = round(n * k * 2 / 4.28e12 * 1e6, 2)
        variants = {}
        if m <= 16:
            for c in args.gemv_configs:
                variants[f"gemv {c}"] = (kernel(kquant.gemv, tuple(map(int, c.split(",")))), copies)
            variants["int4 gemv"] = (
                lambda x, i: w4a16_gemv.gemv(x, qws[i], zeros, scales, None, 128), int4[1])  # fmt: skip
        for c in args.gemm_configs:
            variants[f"gemm {c}"] = (kernel(kquant.gemm, tuple(map(int, c.split(",")))), copies)
        variants["int4 gemm"] = (
            lambda x, i: w4a16.gemm(x, qws[i], zeros, scales, None, 128), int4[1])  # fmt: skip
        variants["cublas bf16"] = (lambda x, i: F.linear(x, bfs[i]), bf16_copies)
        time_variants(row, variants, x, ref, args.rounds, exact=("cublas", "int4"))
        print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K"],
                    choices=["Q4_K", "Q5_K", "Q6_K"])  # fmt: skip
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--shapes", nargs="+", default=["qkv", "o_proj", "gate_up", "down"],
                    choices=list(SHAPES))  # fmt: skip
    ap.add_argument("--gemv-configs", nargs="+", default=GEMV_CONFIGS)
    ap.add_argument("--gemm-configs", nargs="+", default=GEMM_CONFIGS)
    ap.add_argument("--rounds", type=int, default=5, help="timed replays (median)")
    args = ap.parse_args()
    import torch

    for qtype in args.types:
        for name in args.shapes:
            bench_shape(name, qtype, args)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
