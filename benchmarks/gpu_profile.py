"""Where a step's time goes on the GPU: device time per step (CUDA events around graph replays),
wall time per engine step, and the kernels of one eager step (torch.profiler), for

    decode  batch 1 at a 1,000-token context        (the single-stream latency case)
    decode  batch 384 at a ~1,500-token context      (the 1,000/1,000 throughput case)
    mixed   the same 384 decodes plus new 1,000-token prompts filling the step budget

    python benchmarks/gpu_profile.py [--out DIR]   (Llama-3.1-8B shape, dummy weights, bf16)
    python benchmarks/gpu_profile.py --phase fp8w --cases none   (FP8 or INT4 weights: gpu_h200's phases)

Prints a table per case and writes DIR/profile.json. ``FULCRUM_BENCH_SMOKE=N`` runs a CPU dry run
on the SmolLM2 shape (see gpu_h200.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402


def _add(llm, n: int, n_in: int, n_out: int, seed: int) -> list[str]:
    from fulcrum import SamplingParams

    rng = random.Random(seed)
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    top = min(120000, llm.core.config.model_config.vocab_size)
    return [llm._add([rng.randrange(1000, top) for _ in range(n_in)], sp) for _ in range(n)]


def _step_until(core, pred, limit: int = 100000) -> None:
    for _ in range(limit):
        if pred():
            return
        core.step()


def _all_decoding(core, min_out: int) -> bool:
    """Every request admitted (none waiting) and past ``min_out`` output tokens. (An empty
    running set alone would pass a bare ``all(...)`` before the first step ran.)"""
    sched = core.scheduler
    return (
        bool(sched.running)
        and not sched.waiting
        and all(r.num_output_tokens > min_out for r in sched.running)
    )


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _replay_ms(runner, batch: int, iters: int = 50) -> float | None:
    """Device time of one decode-graph replay (static inputs as the last real step left them)."""
    import torch

    graphs = runner.graphs
    if graphs is None or not torch.cuda.is_available():
        return None
    return g.replay_ms(graphs.graphs[graphs.bucket(batch)], iters)


def _wall_ms(core, steps: int) -> dict:
    """Median wall time of engine steps and of the host's launch of a step inside them
    (``execute_async``: inputs, graph replay or eager forward, sampling -- not waiting)."""
    runner = core.runner
    orig = runner.execute_async
    ex: list[float] = []

    def timed(out, *args):
        t0 = time.perf_counter()
        res = orig(out, *args)
        ex.append(time.perf_counter() - t0)
        return res

    runner.execute_async = timed
    walls = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
    finally:
        runner.execute_async = orig
    return {"step_ms": 1e3 * g._median(walls), "launch_ms": 1e3 * g._median(ex)}


def _kernels(core, steps: int, eager: bool = True, top: int = 25) -> dict:
    """Kernel time per step of ``steps`` engine steps (eager: graphs show as one launch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner = core.runner
    was = runner.use_cuda_graphs
    runner.use_cuda_graphs = not eager and was
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        core.step()  # warm the eager path
        _sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                core.step()
            _sync()
    finally:
        runner.use_cuda_graphs = was
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if dev > 0 and e.device_type.name == "CUDA":
            rows.append((dev / steps / 1e3, e.count // steps, e.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    return {
        "device_ms_per_step": total,
        "kernels_per_step": launches,
        "top": [{"ms": round(ms, 4), "count": c, "name": k} for ms, c, k in rows[:top]],
    }


def _critical_path(runner, batch: int, steps: int = 5, show: int = 24) -> dict:
    """Which kernels of a decode-graph replay the step waits for. Kernels launched early
    (programmatic dependent launch) overlap their predecessors, so a kernel's duration says
    little; its *marginal* time -- its end minus the latest end before it -- is what it adds
    to the step. Summed per kernel name, and listed for the step's first ``show`` kernels
    (the embedding and the first layers), averaged over ``steps`` replays."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.graphs
    if graphs is None or not torch.cuda.is_available():
        return {}
    graph = graphs.graphs[graphs.bucket(batch)]
    graph.replay()
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
            _sync()
            time.sleep(0.002)  # a gap that marks where a replay ends
    evs = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    # split into replays at the idle gaps between them
    runs, cur, last_end = [], [], None
    for s, e, name in evs:
        if last_end is not None and s - last_end > 1000:
            runs.append(cur)
            cur = []
        cur.append((s, e, name))
        last_end = e if last_end is None else max(last_end, e)
    runs.append(cur)
    runs = [r for r in runs if len(r) == len(runs[-1])]  # whole replays only
    per_name: dict[str, float] = {}
    seq = [[0.0, 0.0, name[:60]] for _, _, name in runs[0][:show]] if runs else []
    for run in runs:
        latest, marginal = min(t[0] for t in run), {}
        for t in sorted(run, key=lambda t: t[1]):  # by end
            marginal[id(t)] = max(0.0, t[1] - latest)
            latest = max(latest, t[1])
            per_name[t[2][:60]] = per_name.get(t[2][:60], 0.0) + marginal[id(t)] / len(runs)
        for i, t in enumerate(sorted(run)[:show]):
            seq[i][0] += (t[1] - t[0]) / len(runs)
            seq[i][1] += marginal[id(t)] / len(runs)
    total = sum(per_name.values())
    return {
        "replays": len(runs),
        "kernels_per_replay": len(runs[0]) if runs else 0,
        "span_us": round(total, 1),
        "marginal_us_by_kernel": {
            k: round(v, 1) for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])
        },
        "first_kernels (duration_us, marginal_us, name)": [
            [round(d, 2), round(m, 2), n] for d, m, n in seq
        ],
    }


def _timeline(core, steps: int) -> dict:
    """Graphs and asynchronous scheduling as configured: how much of the wall time the device
    is busy, and the longest idle gaps between its operations (host work not hidden)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}
    core.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = time.perf_counter() - t0
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    if not spans:
        return {"wall_ms_per_step": 1e3 * wall / steps, "device_events": 0}
    busy, gaps = 0.0, []
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span_us = spans[-1][1] - spans[0][0]
    gaps.sort(reverse=True)
    return {
        "wall_ms_per_step": 1e3 * wall / steps,
        "device_span_ms_per_step": span_us / 1e3 / steps,
        "device_busy_ms_per_step": busy / 1e3 / steps,
        "idle_gaps_us_top": [round(g, 1) for g in gaps[:12]],
        "idle_gaps_over_20us": sum(1 for g in gaps if g > 20),
        "idle_us_per_step": sum(gaps) / steps,
    }


def main() -> None:
    import logging

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for profile.json")
    ap.add_argument("--batch", type=int, default=384, help="decode batch of the large case")
    ap.add_argument("--ctx", type=int, default=1500, help="prompt tokens of the large case")
    ap.add_argument(
        "--cases",
        default="large,mixed",
        help="comma-separated cases after batch 1 (which always runs): large, mixed",
    )
    ap.add_argument(
        "--phase",
        default="bf16",
        choices=["bf16", *g.FP8W],
        help="weights: bf16, or one of gpu_h200.py's FP8/INT4 phases (its model and engine)",
    )
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from fulcrum import LLM

    model, engine = g.MODEL, dict(g.ENGINE)
    weight_bytes, kv_bytes = g.WEIGHT_BYTES, g.KV_BYTES
    if args.phase != "bf16":
        ph = g.FP8W[args.phase]
        weight_bytes, kv_bytes = ph["weight_bytes"], ph["kv_bytes"]
        model = model if g.SMOKE else ph["model"]
        engine.update(ph["engine"])

    def floor_ms(batch: int, ctx: float) -> float:
        return 1e3 * (weight_bytes + batch * ctx * kv_bytes) / g.BW

    llm = LLM(model, **engine)
    core = llm.core
    res: dict = {"engine": engine, "model": model, "phase": args.phase}
    smoke = g.SMOKE or 1
    batch, ctx = max(1, args.batch // smoke), max(8, args.ctx // smoke)

    # 1. batch 1
    _add(llm, 1, 1000 // smoke, 400, 1)
    _step_until(core, lambda: _all_decoding(core, 2))
    res["decode_b1"] = {
        "graph_replay_ms": _replay_ms(core.runner, 1),
        "critical_path": _critical_path(core.runner, 1),
        **_wall_ms(core, 30),
        "floor_ms": floor_ms(1, 1000),
        "timeline": _timeline(core, 20),
        "eager": _kernels(core, 3),
    }
    print(json.dumps({"decode_b1": res["decode_b1"]}, indent=1), flush=True)
    core.abort_requests(list(core.scheduler.requests))
    _step_until(core, lambda: not core.has_unfinished_requests())
    if "large" not in cases:
        return _save(args.out, res)

    # 2. batch 384 at ~1.5k context
    _add(llm, batch, ctx, 400, 2)
    _step_until(
        core,
        lambda: (
            len(core.scheduler.running) == batch
            and all(r.num_output_tokens > 2 for r in core.scheduler.running)
        ),
    )
    res["decode_large"] = {
        "batch": batch,
        "ctx": ctx,
        "graph_replay_ms": _replay_ms(core.runner, batch, 10),
        **_wall_ms(core, 10),
        "floor_ms": floor_ms(batch, ctx),
        "timeline": _timeline(core, 5),
        "eager": _kernels(core, 2),
    }
    print(json.dumps({"decode_large": res["decode_large"]}, indent=1), flush=True)
    if "mixed" not in cases:
        return _save(args.out, res)

    # 3. mixed: new prompts join the running decodes
    budget = core.config.scheduler_config.max_num_batched_tokens
    n_new = max(1, (budget - batch) // (1000 // smoke))
    core.abort_requests(list(core.scheduler.requests)[:n_new])  # make room under max_num_seqs
    core.step()
    _add(llm, n_new, 1000 // smoke, 8, 3)
    t0 = time.perf_counter()
    core.step()
    _sync()
    first = time.perf_counter() - t0
    res["mixed"] = {
        "new_prompts": n_new,
        "first_step_ms": 1e3 * first,
        "eager": _kernels(core, 2),
    }
    print(json.dumps({"mixed": res["mixed"]}, indent=1), flush=True)
    _save(args.out, res)


def _save(out: str | None, res: dict) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "profile.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
