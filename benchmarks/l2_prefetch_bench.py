"""Does an L2 prefetch issued before a latency-bound stretch speed up the batch-1 GEMV after it?

Per Llama-3.1-8B weight shape, a CUDA graph runs, over enough weight copies that L2 starts cold
for each, ``[prefetch(W_i, n)] ; spin(window) ; x @ W_i.T`` -- the spin stands for the norms,
rotary, KV write and attention that run between two GEMVs of a decode step and leave HBM idle.
Reported: device µs per iteration beyond the spin alone, for prefetch sizes ``n`` and request
chunk sizes, next to the GEMV's HBM floor (bytes / 4.28 TB/s).

    PYTHONPATH=src python benchmarks/l2_prefetch_bench.py [--windows 3 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from fulcrum.kernels.l2_prefetch import prefetch

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
MB = 1 << 20


def _graph_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000 / iters)
    return sorted(times)[2]


def _cycles_for(us: float) -> int:
    probe = 100_000
    t = _graph_us(lambda: [torch.cuda._sleep(probe) for _ in range(20)], 20)
    return max(1, int(probe * us / t))


def _shape_rows(name: str, n: int, k: int, args) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    nbytes = n * k * 2
    copies = max(4, int(args.gib * (1 << 30) / nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(copies)]
    xin = torch.randn(1, k, device=dev, dtype=dt)
    floor = nbytes / 4.28e12 * 1e6
    rows = []
    for window in args.windows:
        cyc = _cycles_for(window)
        spin = _graph_us(lambda cyc=cyc: [torch.cuda._sleep(cyc) for _ in ws], len(ws))
        for size in args.sizes_mb:
            for chunk in args.chunks if size else [0]:
                nb = int(size * MB)

                def it(nb=nb, chunk=chunk, cyc=cyc):
                    for w in ws:
                        if nb:
                            prefetch(w, nb, chunk=chunk)
                        torch.cuda._sleep(cyc)
                        torch.nn.functional.linear(xin, w)

                us = _graph_us(it, len(ws)) - spin
                row = dict(
                    shape=name,
                    mb=size,
                    chunk=chunk,
                    window_us=window,
                    spin_us=round(spin, 2),
                    gemv_us=round(us, 2),
                    floor_us=round(floor, 2),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=float, nargs="+", default=[3.0, 10.0], help="spin µs")
    p.add_argument(
        "--sizes-mb", type=float, nargs="+", default=[0, 8, 16, 32, 48], help="prefetch MB"
    )
    p.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    p.add_argument("--gib", type=float, default=2.0, help="weight copies per shape, in GiB")
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args()
    rows: list[dict] = []
    print(f"device: {torch.cuda.get_device_name()}")
    for name, (n, k) in SHAPES.items():
        rows += _shape_rows(name, n, k, args)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
