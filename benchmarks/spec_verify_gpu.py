"""Cost of a speculative verify step on the H200: Llama-3.1-8B shape (dummy weights, bf16), one
engine step of B requests at a ~1,000-token context, each verifying k guessed tokens (k + 1
query tokens per request), for k = 0..8 and B = 1, 8, 64.

k = 0 is the plain decode step (decode CUDA graph, asynchronous scheduling as configured); k = 0
"sync" is the same with speculation's one-step-at-a-time scheduling; k >= 1 runs the verify
step (piecewise graphs or eager, by the step's token count). Guesses are fixed (the last token
repeated), so nearly all are rejected: the figure is the verify cost, not a speed-up. A k is
worth proposing while (mean acceptance length) x (k = 0 step time) > (k step time).

    PYTHONPATH=src python3 benchmarks/spec_verify_gpu.py [--batches 1 8 64] [--max-k 8]
        [--steps 30] [--ctx 1000]
    FULCRUM_BENCH_SMOKE=8 ... runs it on the CPU with the SmolLM2 shape (a dry run).

Prints one ``RESULT {json}`` line per (batch, k): median step ms, the decode floor and
tokens/s if every guess were accepted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402

from fulcrum.spec_decode.proposer import Proposer  # noqa: E402


class FixedProposer(Proposer):
    """Always ``k`` guesses: the last token repeated."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return [token_ids[-1]] * min(self.k, max_tokens)


def measure(llm, batch: int, k: int, ctx: int, steps: int, sync: bool) -> float:
    from fulcrum.protocol import EngineCoreRequest, WireSamplingParams

    core = llm.core
    sched = core.scheduler
    # no proposer: the plain engine (overlapping steps); a proposer of 0 guesses: the same
    # steps one at a time
    sched.proposer = FixedProposer(k) if sync else None
    rng = random.Random(batch * 100 + k)
    top = 40000 if g.SMOKE else 120000
    for i in range(batch):
        sp = WireSamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        prompt = [rng.randrange(1000, top) for _ in range(ctx)]
        core.add_request(EngineCoreRequest(f"b{batch}k{k}s{int(sync)}-{i}", prompt, sp))
    while any(not r.prefill_done for r in sched.running) or sched.waiting:
        core.step()
    for _ in range(3):  # warm: the first verify steps compile/capture
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    sched.abort_requests(list(sched.requests))
    while core.has_unfinished_requests():
        core.step()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=1000)
    args = ap.parse_args()
    from fulcrum import LLM

    ctx = max(8, args.ctx // g.SMOKE) if g.SMOKE else args.ctx
    spec = {"method": "ngram", "num_speculative_tokens": args.max_k, "disable_by_batch_size": 4096}
    llm = LLM(g.MODEL, **g.ENGINE, speculative_config=spec)
    for b in args.batches:
        base = None
        cases = [(0, False), (0, True)] + [(k, True) for k in range(1, args.max_k + 1)]
        for k, sync in cases:
            s = measure(llm, b, k, ctx, args.steps, sync)
            base = base or s
            g.emit(
                "spec_verify",
                batch=b, k=k, sync=sync, ctx=ctx, step_ms=s * 1e3,
                floor_ms=g.decode_floor_s(b, ctx) * 1e3,
                ratio_to_k0=s / base,
                tok_s_all_accepted=b * (k + 1) / s,
            )


if __name__ == "__main__":
    main()
