"""Sampling a decode step's logits: the sorting sampler (``worker/sampler.py``: metadata,
sort, softmax, cumulative sum, noise, argmax) against the sort-free kernels
(``kernels/sample.py`` through ``sampler.sample_fused``), Llama-3's 128,256-token vocabulary,
bf16 logits as the LM head writes them.

Each figure is the wall time per call over ``--iters`` back-to-back calls (host work and
device work, whichever bounds), beside the floor of reading the logits once at 4.28 TB/s.
``--device-time`` instead times the sort-free kernels alone (``sample_rows``), replayed from a
CUDA graph as a decode graph runs them, with ``skip_greedy`` too (what a greedy decode graph
pays for holding the sampler) and a case of greedy rows.

    PYTHONPATH=src python benchmarks/sampler_bench.py [--batch 1 8 64 384] [--iters 50]
        [--device-time]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

from fulcrum.kernels.sample import KEY_STRIDE, pack_params, sample_rows
from fulcrum.protocol import WireSamplingParams
from fulcrum.worker.sampler import Sampler, SamplingMetadata, sample_fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200  # noqa: E402  (the CUDA-graph capture and replay timing it shares)

VOCAB, COPY_BW = 128256, 4.28e12
CASES = {
    "t0.8 top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "t0.7 top-k 50": dict(temperature=0.7, top_k=50),
    "t1.0 min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "t0.8 top-p 0.95 seeded": dict(temperature=0.8, top_p=0.95, seed=1),
}


def _time(iters: int, fn, *args) -> float:
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _graph_us(iters: int, fn) -> float:
    """Device time per call of ``fn`` captured in a CUDA graph and replayed ``iters`` times."""
    return gpu_h200.replay_ms(gpu_h200.capture_graph(fn), iters) * 1e3


def device_times(batches: list[int], iters: int) -> None:
    cases = {**{k: v for k, v in CASES.items() if "seed" not in v}, "greedy rows": {}}
    for b in batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        logits = (torch.randn(b, VOCAB, device="cuda", generator=g) * 2.5).to(torch.bfloat16)
        for name, kw in cases.items():
            row = [kw.get("temperature", 0.0), kw.get("top_k", -1), kw.get("top_p", 1.0),
                   kw.get("min_p", 0.0)]  # fmt: skip
            keys = [17 + i * KEY_STRIDE for i in range(b)]
            params = torch.from_numpy(pack_params([row] * b, keys)).cuda()
            out = torch.zeros(b, dtype=torch.int64, device="cuda")
            call = functools.partial(sample_rows, logits, params, out)
            us = _graph_us(iters, call)
            skip = _graph_us(iters, functools.partial(call, skip_greedy=True))
            r = dict(name="sampler_device", batch=b, case=name, kernels_us=round(us, 1),
                     skip_greedy_us=round(skip, 1), floor_us=round(b * VOCAB * 2 / COPY_BW * 1e6, 2))  # fmt: skip
            print("RESULT " + json.dumps(r), flush=True)


def _sorting(sampler: Sampler, logits: torch.Tensor, params: list, gens: list) -> torch.Tensor:
    outs: list[list[int]] = [[] for _ in params]
    meta = SamplingMetadata.build(params, gens, outs, None, VOCAB, "cuda")
    return sampler(logits.float(), meta).sampled_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 384], help="rows")
    ap.add_argument("--iters", type=int, default=50, help="calls timed per figure")
    ap.add_argument(
        "--device-time",
        action="store_true",
        help="time the sort-free kernels alone, replayed from a CUDA graph",
    )
    args = ap.parse_args()
    if args.device_time:
        device_times(args.batch, args.iters)
        return
    sampler = Sampler()
    for b in args.batch:
        g = torch.Generator(device="cuda").manual_seed(b)
        logits = (torch.randn(b, VOCAB, device="cuda", generator=g) * 2.5).to(torch.bfloat16)
        floor_us = b * VOCAB * 2 / COPY_BW * 1e6
        for name, kw in CASES.items():
            params = [WireSamplingParams(**kw)] * b
            gens = [
                torch.Generator(device="cuda").manual_seed(i) if "seed" in kw else None
                for i in range(b)
            ]

            sort_us = _time(args.iters, _sorting, sampler, logits, params, gens) * 1e6
            where = list(range(b))
            fused_us = _time(args.iters, sample_fused, logits, params, [0] * b, where) * 1e6
            print(
                "RESULT "
                + json.dumps(
                    dict(
                        name="sampler",
                        batch=b,
                        case=name,
                        sorting_us=round(sort_us, 1),
                        fused_us=round(fused_us, 1),
                        speedup=round(sort_us / fused_us, 2),
                        floor_us=round(floor_us, 2),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
