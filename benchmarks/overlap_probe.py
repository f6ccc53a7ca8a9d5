"""Can bandwidth-bound decode attention and compute-bound GEMMs overlap on one H200? The
go/no-go for running a large decode batch as two half-batches on two streams.

At batch 384 and a ~1,500-token context a decode step is ~2/3 paged attention (bandwidth
bound) and ~1/3 weight GEMMs (compute bound), run one after the other. Split into two
half-batches A and B, A's attention could run while B's GEMMs do -- at the price of reading
every weight twice (once per half). This times, per Llama-3.1-8B layer (dummy weights, bf16,
``--layers`` layers chained in one CUDA graph):

    sequential   attention(B) then GEMMs(B): the engine's schedule today
    halves       attention(B/2), GEMMs(B/2), attention(B/2), GEMMs(B/2) on one stream
    two streams  stream 1: [attention(A), GEMMs(A)] per layer; stream 2: [GEMMs(B),
                 attention(B)] per layer, started out of phase

GEMMs are the layer's four projections (qkv, o_proj, gate_up, down) on cuBLAS; attention is
``decode_attention`` over a shuffled paged cache.

    python benchmarks/overlap_probe.py [--batch 384] [--ctx 1500] [--layers 8]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from fulcrum.kernels.decode_attention import DecodeWorkspace, decode_attention

HQ, HKV, D, PAGE, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=384, help="decode batch (split in two halves)")
    p.add_argument("--ctx", type=int, default=1500, help="context tokens per request")
    p.add_argument("--layers", type=int, default=8, help="layers chained in each graph")
    args = p.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    b, half = args.batch, args.batch // 2
    per_req = -(-args.ctx // PAGE)
    cache = torch.randn(2, b * per_req, PAGE, HKV, D, device=dev, dtype=bf16)
    table = torch.randperm(b * per_req, device=dev).to(torch.int32).view(b, per_req)
    seq_lens = torch.full((b,), args.ctx, device=dev, dtype=torch.int32)
    q = torch.randn(b, HQ, D, device=dev, dtype=bf16)
    out = torch.empty_like(q)
    weights = [
        torch.randn(n, k, device=dev, dtype=bf16) * 0.02
        for n, k in ((HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN))
    ] + [torch.randn(HIDDEN, INTER, device=dev, dtype=bf16) * 0.02]
    x = torch.randn(b, HIDDEN, device=dev, dtype=bf16)
    act = torch.randn(b, INTER, device=dev, dtype=bf16)
    ws = [DecodeWorkspace(), DecodeWorkspace()]

    def attention(rows: slice, w: int) -> None:
        decode_attention(
            q[rows], cache, table[rows], seq_lens[rows], D**-0.5, out=out[rows], workspace=ws[w]
        )

    def gemms(rows: slice) -> None:
        qkv, o, gate_up, down = weights
        torch.mm(x[rows], qkv.t())
        torch.mm(x[rows], o.t())
        torch.mm(x[rows], gate_up.t())
        torch.mm(act[rows], down.t())

    full, lo, hi = slice(0, b), slice(0, half), slice(half, b)
    side = torch.cuda.Stream()

    def sequential() -> None:
        for _ in range(args.layers):
            attention(full, 0)
            gemms(full)

    def halves() -> None:
        for _ in range(args.layers):
            attention(lo, 0)
            gemms(lo)
            attention(hi, 1)
            gemms(hi)

    def two_streams() -> None:
        main_s = torch.cuda.current_stream()  # the capture stream while capturing
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            for _ in range(args.layers):
                gemms(hi)
                attention(hi, 1)
        for _ in range(args.layers):
            attention(lo, 0)
            gemms(lo)
        main_s.wait_stream(side)

    def only(part) -> None:
        for _ in range(args.layers):
            part()

    cases = {
        "attention(B)": lambda: only(lambda: attention(full, 0)),
        "GEMMs(B)": lambda: only(lambda: gemms(full)),
        "sequential": sequential,
        "halves, one stream": halves,
        "two streams": two_streams,
    }
    graphs = {}
    for name, fn in cases.items():
        fn()  # warm-up: compiles, sizes the workspaces
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    print(f"batch {b} (halves of {half}), context {args.ctx}, {args.layers} layers; per layer:")
    for name, graph in graphs.items():
        ms = triton.testing.do_bench(graph.replay, warmup=50, rep=300)
        print(f"  {name:<22s} {ms * 1e3 / args.layers:8.1f} us")


if __name__ == "__main__":
    main()
