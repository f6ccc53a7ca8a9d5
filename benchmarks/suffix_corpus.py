"""Suffix decoding's store of finished outputs under a serving load, on the CPU: the time each
finished request adds to the engine's loop (``on_finished``), the process's memory, a full
garbage collection afterwards, and a proposal's time against the full store.

    PYTHONPATH=src python benchmarks/suffix_corpus.py [--outputs 1000] [--len 200]
        [--vocab 30000] [--keep 1000]

Outputs are random token ids: almost every pattern longer than a few tokens is new, as in
varied real traffic. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import time

from fulcrum.spec_decode.suffix import SuffixProposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", type=int, default=1000, help="finished requests")
    ap.add_argument("--len", type=int, default=200, help="output tokens of each")
    ap.add_argument("--vocab", type=int, default=30000, help="token ids drawn from [0, vocab)")
    ap.add_argument("--keep", type=int, default=1000, help="suffix_decoding_max_cached_requests")
    args = ap.parse_args()
    rng = random.Random(0)
    p = SuffixProposer(max_depth=24, max_cached_requests=args.keep, spec_factor=1.0, min_prob=0.1)
    finish: list[float] = []
    t0 = time.perf_counter()
    for r in range(args.outputs):
        toks = [rng.randrange(args.vocab) for _ in range(args.len)]
        t = time.perf_counter()
        p.on_finished(str(r), toks, 0)
        finish.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    t = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - t
    ctx = [rng.randrange(args.vocab) for _ in range(600)]
    props: list[float] = []
    for _ in range(200):
        ctx.append(rng.randrange(args.vocab))
        t = time.perf_counter()
        p.propose("x", ctx, 4)
        props.append(time.perf_counter() - t)
    row = {
        "outputs": args.outputs,
        "len": args.len,
        "keep": args.keep,
        "finish_total_s": round(total, 3),
        "finish_median_ms": round(statistics.median(finish) * 1e3, 3),
        "finish_worst_ms": round(max(finish) * 1e3, 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "full_gc_ms": round(gc_s * 1e3, 1),
        "propose_median_us": round(statistics.median(props) * 1e6, 1),
    }
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
