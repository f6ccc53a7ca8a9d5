"""The batch-1 linear layers of Llama-3.1-8B, Triton GEMV (``kernels/gemv.py``, launch configs)
against cuBLAS, each after the kernel that precedes it in the model (fused add + RMSNorm), as in
a decode step: a CUDA graph of ``norm → linear`` pairs over enough weight copies (≥ 2 GB) that
every weight comes from HBM, not L2. Reports µs per pair and the weight's floor at 4.28 TB/s.
With ``--fp8`` the weights are e4m3 with row scales, against the FP8 layer's GEMM path
(per-token activation quantization, then ``torch._scaled_mm``); one row takes the int32-word
path, and ``--byte-configs`` adds the byte-by-byte widening beside it.

    python benchmarks/gemv_bench.py [--m 1 2 4] [--configs 8,512,4 16,256,4 ...] [--fp8]
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
    "lm_head": (128256, 4096),
}
CONFIGS = [
    "4,1024,4",
    "8,512,4",
    "8,1024,4",
    "16,512,4",
    "16,256,4",
    "4,2048,4",
    "8,1024,8",
    "2,2048,4",
    "32,256,4",
]


def bench_shape(name: str, args: argparse.Namespace) -> None:
    """One weight shape at every ``--m``: a RESULT line per row count."""
    import torch
    import torch.nn.functional as F

    from fulcrum.config import PdlConfig
    from fulcrum.kernels import gemv
    from fulcrum.kernels.quant_fp8 import per_token_quant_fp8
    from fulcrum.kernels.rmsnorm import fused_add_rms_norm
    from fulcrum.quant.fp8 import quantize_rows

    dev, dt = "cuda", torch.bfloat16
    n, k = SHAPES[name]
    nbytes = n * k * (1 if args.fp8 else 2)
    copies = max(2, -(-2_000_000_000 // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    scales: list[torch.Tensor | None] = [None] * copies
    if args.fp8:
        for i, w in enumerate(ws):
            ws[i], scales[i] = quantize_rows(w)
    wn = torch.ones(k, device=dev, dtype=dt)
    pc = PdlConfig(enabled=bool(args.pdl))  # every Triton launch below takes it

    def scaled_mm(h: torch.Tensor, i: int) -> torch.Tensor:
        q, s = per_token_quant_fp8(h, pc)
        sw = scales[i].view(1, -1)
        return torch._scaled_mm(q, ws[i].t(), scale_a=s, scale_b=sw, out_dtype=dt)

    def gemv_with(cfg: tuple[int, ...], words: bool = True):
        return lambda h, i: gemv.gemv(
            h, ws[i], config=cfg, scale=scales[i], pdl_cfg=pc, fp8_words=words
        )

    variants = {"cublas": scaled_mm if args.fp8 else (lambda h, i: F.linear(h, ws[i]))}
    for c in args.configs:
        variants[f"gemv {c}"] = gemv_with(tuple(int(v) for v in c.split(",")))
    for c in args.byte_configs if args.fp8 else []:
        variants[f"gemv bytes {c}"] = gemv_with(tuple(int(v) for v in c.split(",")), False)
    for m in args.m:
        x = torch.randn(m, k, device=dev, dtype=dt)
        res = torch.randn(m, k, device=dev, dtype=dt)

        def chain(lin, x=x, res=res):
            def run() -> None:
                for i in range(copies):
                    h, _ = fused_add_rms_norm(x, res, wn, 1e-5, pc)
                    lin(h, i)

            return run

        h0, _ = fused_add_rms_norm(x, res, wn, 1e-5, pc)
        ref = F.linear(h0.float(), ws[0].float())
        if args.fp8:
            ref = ref * scales[0]
        row = {"shape": name, "fp8": args.fp8, "n": n, "k": k, "m": m}
        row["floor_us"] = round(nbytes / 4.28e12 * 1e6, 2)
        norms = chain(lambda h, i: None)
        row["norm_only_us"] = round(g.replay_ms(g.capture_graph(norms), 3) * 1e3 / copies, 2)
        for vname, lin in variants.items():
            try:
                y = lin(h0, 0).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                graph = g.capture_graph(chain(lin))
                t = [g.replay_ms(graph, 1) for _ in range(args.rounds)]
                row[vname] = round(statistics.median(t) * 1e3 / copies, 2)
                if err > 2e-2:
                    row[vname + " err"] = err
                del graph
            except Exception as e:  # noqa: BLE001  (a config that does not compile)
                row[vname] = repr(e)[:100]
        print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4], help="rows of x")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="block_n,block_k,num_warps")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--pdl", type=int, default=1, help="1: the Triton kernels launch with PDL")
    ap.add_argument("--rounds", type=int, default=5, help="timed replays (median)")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights with one scale per row")
    ap.add_argument(
        "--byte-configs",
        nargs="*",
        default=[],
        help="with --fp8: launch configs of the byte-by-byte widening (gemv.fp8_words off) "
        "beside --configs, which one row runs on the int32-word path",
    )
    args = ap.parse_args()
    import torch

    for name in args.shapes:
        bench_shape(name, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
