"""Sampling a decode step's logits: the sorting sampler (``worker/sampler.py``: metadata,
sort, softmax, cumulative sum, noise, argmax) against the sort-free kernels
(``kernels/sample.py`` through ``sampler.sample_fused``), Llama-3's 128,256-token vocabulary,
bf16 logits as the LM head writes them.

Each figure is the wall time per call over ``--iters`` back-to-back calls (host work and
device work, whichever bounds), beside the floor of reading the logits once at 4.28 TB/s.

    PYTHONPATH=src python benchmarks/sampler_bench.py [--batch 1 8 64 384] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fulcrum.protocol import WireSamplingParams
from fulcrum.worker.sampler import Sampler, SamplingMetadata, sample_fused

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


def _sorting(sampler: Sampler, logits: torch.Tensor, params: list, gens: list) -> torch.Tensor:
    outs: list[list[int]] = [[] for _ in params]
    meta = SamplingMetadata.build(params, gens, outs, None, VOCAB, "cuda")
    return sampler(logits.float(), meta).sampled_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 384], help="rows")
    ap.add_argument("--iters", type=int, default=50, help="calls timed per figure")
    args = ap.parse_args()
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
