"""Where a single-stream decode step's time goes between CUDA-graph replays, in the real engine
loop (asynchronous scheduling as configured). CUDA events are recorded on the stream at four
points of every step the runner launches::

    e0  execute_async starts (before the step's input copies and the sampled-id patch)
    e1  just before the graph replay
    e2  just after it
    e3  after the sampled ids' device → host copy is queued

and per step the device-side intervals are reported: inputs (e1 - e0), graph (e2 - e1), output
copy (e3 - e2) and the gap to the next step's e0 (> 0: the device waited for the host). Their
sum is the inter-token latency. Compared with a back-to-back replay of the same graph.

    python benchmarks/step_gap.py [--steps 200] [--ctx 1000]   (Llama-3.1-8B shape, dummy, bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402
from gpu_profile import _add, _all_decoding, _step_until  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed")
    ap.add_argument("--ctx", type=int, default=1000, help="prompt tokens")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights and KV cache")
    args = ap.parse_args()
    import torch

    from fulcrum import LLM

    engine = dict(g.ENGINE, quantization="fp8", kv_cache_dtype="fp8") if args.fp8 else g.ENGINE
    llm = LLM(g.MODEL, **engine)
    core, runner = llm.core, llm.core.runner
    if runner.graphs is None or not torch.cuda.is_available():
        print("needs CUDA graphs (a CUDA device, not --enforce-eager)")
        return
    _add(llm, 1, args.ctx, args.steps + 50, 1)
    _step_until(core, lambda: _all_decoding(core, 3))

    marks: list[dict[str, torch.cuda.Event]] = []

    def mark(name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks[-1][name] = ev

    graphs, orig_exec, orig_replay, orig_host = (
        runner.graphs,
        runner.execute_async,
        runner.graphs.replay,
        runner.sampling.to_host,
    )

    def execute_async(out, *args):
        marks.append({})
        mark("e0")
        return orig_exec(out, *args)

    def replay(b, n):
        mark("e1")
        res = orig_replay(b, n)
        mark("e2")
        return res

    def to_host(*tensors):
        res = orig_host(*tensors)
        mark("e3")
        return res

    runner.execute_async, graphs.replay, runner.sampling.to_host = execute_async, replay, to_host
    walls = []
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    finally:
        runner.execute_async, graphs.replay, runner.sampling.to_host = (
            orig_exec,
            orig_replay,
            orig_host,
        )
    full = [m for m in marks if len(m) == 4]
    parts: dict[str, list[float]] = {"inputs": [], "graph": [], "output_copy": [], "gap": []}
    for m, nxt in zip(full, full[1:], strict=False):
        parts["inputs"].append(m["e0"].elapsed_time(m["e1"]))
        parts["graph"].append(m["e1"].elapsed_time(m["e2"]))
        parts["output_copy"].append(m["e2"].elapsed_time(m["e3"]))
        parts["gap"].append(m["e3"].elapsed_time(nxt["e0"]))
    res = {k: round(statistics.median(v) * 1e3, 1) for k, v in parts.items()}  # µs
    res["step_total_us"] = round(sum(res[k] for k in parts), 1)
    res["wall_ms_median"] = round(statistics.median(walls) * 1e3, 3)
    res["gap_us_p90"] = round(sorted(parts["gap"])[int(0.9 * len(parts["gap"]))] * 1e3, 1)
    b = graphs.bucket(1)
    res["bare_replay_ms"] = round(g.replay_ms(graphs.graphs[b], 50), 4)
    res["steps"] = len(parts["gap"])
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
