"""Microbenchmark of the fused MoE kernels (one layer's routed experts) at Mixtral-8x7B and
Qwen3-30B-A3B expert shapes, against the per-expert torch loop and against the physical floor.

A layer's experts read the weights of every expert its tokens picked (bandwidth) and do
2 * T * k * 3 * H * I FLOPs (compute); the floor is the larger of bytes / 4.28 TB/s and
FLOPs / 790 TFLOP/s (H200). ``fused`` is the whole path the model runs (top-k softmax, align,
gate_up + SiLU, down + routing weights, the k-sum), replayed from a CUDA graph; ``gemms`` the two
grouped GEMM launches alone; ``torch`` the loop of ``model/layers/moe_ref.py`` (eager: it asks
the host which experts were picked).

    PYTHONPATH=src python benchmarks/moe_bench.py [--batch 1 64 256 512] [--model qwen3-30b-a3b]
        [--fp8 [--act-fp8-rows 0 32]] [--launch 16,64,128,4,3 32,64,128,4,3]
        (launch: block_m,block_n,block_k,warps,stages)

``--act-fp8-rows``: FP8 experts' ``act_fp8_rows`` values to time (``fused_moe``: from that many
rows per expert the activations are quantized too, FP8 x FP8; 0 never); ``act_fp8`` in each row
says which path ran.

Prints a table and a ``RESULT {json}`` line per row.
"""

from __future__ import annotations

import argparse
import json

import torch

from fulcrum.kernels import fused_moe as fm
from fulcrum.kernels.moe_routing import moe_align_block_size, topk_softmax
from fulcrum.kernels.quant_fp8 import per_token_quant_fp8_ref
from fulcrum.model.layers.moe_ref import fused_moe_ref

BW, FLOPS = 4.28e12, 790e12
# name: (experts, top-k, hidden, expert intermediate)
MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def _time_graph(fn, iters: int = 50) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph (``iters`` calls per graph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def _time_eager(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _weights(e, h, inter, fp8: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.empty(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(e, h, inter, device="cuda", dtype=torch.bfloat16)
    w13.uniform_(-0.02, 0.02, generator=g)
    w2.uniform_(-0.02, 0.02, generator=g)
    if not fp8:
        return w13, w2, None, None
    q13, s13 = per_token_quant_fp8_ref(w13.view(-1, h))
    q2, s2 = per_token_quant_fp8_ref(w2.view(-1, inter))
    return (q13.view(e, 2 * inter, h), q2.view(e, h, inter),
            s13.view(e, 2 * inter), s2.view(e, h))  # fmt: skip


def bench(model: str, batch: int, fp8: bool, launches: list, torch_loop: bool,
          act_rows: list[int]) -> list[dict]:  # fmt: skip
    e, k, h, inter = MODELS[model]
    w13, w2, s13, s2 = _weights(e, h, inter, fp8)
    x = torch.randn(batch, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(batch, e, device="cuda")
    weights, ids = topk_softmax(logits, k, True)
    active = int(ids.unique().numel())
    wbytes = active * 3 * h * inter * (1 if fp8 else 2)
    flops = 2 * batch * k * 3 * h * inter
    floor_us = max(wbytes / BW, flops / FLOPS) * 1e6
    h_act = torch.empty(batch * k, inter, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(batch * k, h, device="cuda", dtype=torch.bfloat16)
    rw = weights.reshape(-1).contiguous()
    rows = []
    for launch, act in [(la, a) for la in launches or [None] for a in act_rows]:
        cfg = launch or fm.default_launch(batch * k, e, True)
        act_fp8 = fp8 and 0 < act <= batch * k / e

        def full(cfg=cfg, act=act):
            w, i = topk_softmax(logits, k, True)
            return fm.fused_moe(x, w13, w2, w, i, s13, s2, launch=cfg, act_fp8_rows=act)

        align = moe_align_block_size(ids, e, cfg[0])
        # the GEMMs alone: their inputs quantized beforehand (h: stand-in values)
        xa, xs = per_token_quant_fp8_ref(x) if act_fp8 else (x, None)
        ha, hs = per_token_quant_fp8_ref(torch.randn_like(h_act)) if act_fp8 else (h_act, None)

        def gemms(cfg=cfg, align=align, xa=xa, xs=xs, ha=ha, hs=hs):
            fm._gemm(xa, w13, h_act, s13, None, align, inter, k, True, cfg, xs)
            fm._gemm(ha, w2, y, s2, rw, align, h, 1, False, cfg, hs)

        us, us_gemm = _time_graph(full), _time_graph(gemms)
        row = dict(model=model, batch=batch, fp8=fp8, act_fp8=act_fp8, launch=list(cfg),
                   active_experts=active, fused_us=round(us, 1), gemms_us=round(us_gemm, 1),
                   floor_us=round(floor_us, 1), pct_of_floor=round(100 * floor_us / us, 1),
                   weight_gbps=round(wbytes / us / 1e3, 1))  # fmt: skip
        rows.append(row)
    if torch_loop:
        ref = lambda: fused_moe_ref(x, w13, w2, weights, ids, s13, s2)  # noqa: E731
        t_us = _time_eager(ref, iters=3 if e > 64 else 10)
        for row in rows:
            row.update(torch_us=round(t_us, 1), speedup=round(t_us / row["fused_us"], 1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64, 256, 512])
    ap.add_argument("--fp8", action="store_true", help="FP8 experts (per-row scales)")
    ap.add_argument("--launch", nargs="*", default=[], help="block_m,block_n,block_k,warps,stages")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch loop")
    ap.add_argument(
        "--act-fp8-rows", nargs="+", type=int, default=[0],
        help="FP8 experts: act_fp8_rows values to time (0: weight-only FP8; default: 0)",
    )
    args = ap.parse_args()
    launches = [tuple(int(v) for v in s.split(",")) for s in args.launch]
    print(f"{'model':>14} {'batch':>5} {'launch':>20} {'experts':>7} {'fused us':>9} "
          f"{'gemms us':>9} {'floor us':>9} {'%floor':>6} {'GB/s':>7} {'torch us':>9}")  # fmt: skip
    for model in args.model:
        for batch in args.batch:
            for r in bench(model, batch, args.fp8, launches, not args.no_torch, args.act_fp8_rows):
                print(f"{model:>14} {batch:>5} {str(tuple(r['launch'])):>20} "
                      f"{r['active_experts']:>7} {r['fused_us']:>9} {r['gemms_us']:>9} "
                      f"{r['floor_us']:>9} {r['pct_of_floor']:>6} {r['weight_gbps']:>7} "
                      f"{r.get('torch_us', '-'):>9}")  # fmt: skip
                print("RESULT " + json.dumps(r), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
