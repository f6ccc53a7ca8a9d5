"""The batch-1 decode graph replayed back to back against the same graph inside the engine's
own loop (graphs and asynchronous scheduling, as the ITL benchmark runs), one process:

    back to back   the engine's start-up graph, a fresh capture of the same step (own pool and
                   the engine's pool), and a fresh capture with the split grid releasing at exit
                   (``KernelConfig.attention.split_early`` off); ``replay_ms`` of each, interleaved;
                   then the engine graph with what the engine once ran between graphs
                   (inputs copy, sampled-id patch, ids copy back) added one at a time, period
                   per step (the patch now runs inside the graph: ``graph_patch`` off puts it
                   back between them)
    by token       the same graph and length with other input tokens, and with the token fed
                   back from the graph's argmax (a torch copy) or rewritten by the patch kernel
    after events   50-replay runs after a sync, idle, an eager launch or step, with NVML's SM
                   clock and power
    in the loop    CUDA events around each graph replay of a 1,000-token request's decode
                   steps: the graph's time, the period between replays, the device gap between
                   graphs (the inputs' copy and the ids' copy back)

    python benchmarks/graph_in_loop.py [--rounds 4] [--steps 200]
    (Llama-3.1-8B shape, dummy weights, bf16; needs CUDA)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402
from gpu_profile import _all_decoding, _step_until  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="interleaved back-to-back rounds")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per in-loop trial")
    args = ap.parse_args()
    import torch

    from fulcrum import LLM, SamplingParams

    llm = LLM(g.MODEL, **g.ENGINE)
    core, runner = llm.core, llm.core.runner
    graphs = runner.graphs
    rng = random.Random(0)

    def add(max_tokens: int) -> None:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm._add([rng.randrange(1000, 120000) for _ in range(1000)], sp)

    def med(v: list[float]) -> float:
        return round(statistics.median(v), 4)

    # 1. back to back
    add(3000)
    _step_until(core, lambda: _all_decoding(core, 2))

    base = runner.kernel_config

    def fresh(pool=None, early: bool = True):
        runner.set_kernel_config(base.replace(attention={"split_early": early}))
        try:
            graphs._run_static(1)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                graphs._run_static(1)
        finally:
            runner.set_kernel_config(base)
        return graph

    # right after the engine's own steps: the first replays back to back, 50 at a time
    g.emit(
        "first_back_to_back_ms",
        runs=[round(g.replay_ms(graphs.graphs[1], 50), 4) for _ in range(4)],
    )
    # 1a. does a step's time depend on its input token? The same graph, the same length, with
    # the token row set to other ids (no operation between replays), then with the token fed
    # back from the graph's own argmax, by a torch copy or by the patch kernel
    from fulcrum.kernels.scatter import gather_scatter

    graph1, tok = graphs.graphs[1], graphs.tokens[0, :1]
    logits1, ids1 = graphs.outputs[1]
    staged = tok.clone()
    graph1.replay()
    argmax_of_staged = ids1[:1].clone()

    def probe(name: str, op=None) -> None:
        graph1.replay()
        torch.cuda.synchronize()
        lg = logits1[:1].float()
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            if op is not None:
                op()
            graph1.replay()
        z.record()
        z.synchronize()
        g.emit(
            "by_token_ms",
            case=name,
            ms=round(a.elapsed_time(z) / 50, 4),
            token=int(tok.item()),
            logits_finite=bool(lg.isfinite().all()),
            logits_absmax=float(lg.abs().max()),
        )

    for name, value in (
        ("staged", staged),
        ("argmax of staged", argmax_of_staged),
        ("0", 0),
        ("1", 1),
        ("12345", 12345),
        ("98765", 98765),
    ):
        tok.copy_(value) if isinstance(value, torch.Tensor) else tok.fill_(value)
        probe(f"fixed {name}")
    tok.copy_(staged)
    probe("fed back by a torch copy", lambda: tok.copy_(ids1[:1]))
    tok.copy_(staged)
    const = staged.clone()
    probe("a torch copy of the staged token", lambda: tok.copy_(const))
    rows = torch.zeros(2, 1, dtype=torch.int64, device=tok.device)
    probe("patch kernel from a constant", lambda: gather_scatter(graphs.tokens[0], rows, const))
    tok.copy_(staged)

    times: dict[str, list[float]] = {}
    kept = []
    for _ in range(args.rounds):
        kept.append(fresh(pool=graphs.pool))  # kept: its memory is the engine pool's
        for name, graph in (
            ("engine graph", graphs.graphs[1]),
            ("fresh capture", fresh()),
            ("fresh capture, engine pool", kept[-1]),
            ("fresh capture, split grid released at exit", fresh(early=False)),
        ):
            times.setdefault(name, []).append(g.replay_ms(graph, 50))
    g.emit("back_to_back_ms", **{k: med(v) for k, v in times.items()})
    g.emit("back_to_back_ms_by_round", **{k: [round(x, 4) for x in v] for k, v in times.items()})

    # 1c. what the graph's time follows: 50-replay runs back to back after one event of each
    # kind, with the SM clock (MHz) and power (W) that NVML reports before and after
    def idle(seconds: float):
        return lambda: (torch.cuda.synchronize(), time.sleep(seconds))

    for name, event in (
        ("back to back", lambda: None),
        ("after a sync", torch.cuda.synchronize),
        ("after an eager patch kernel", lambda: gather_scatter(graphs.tokens[0], rows, const)),
        ("after a torch kernel", lambda: logits1.float()),
        ("after an eager decode step", lambda: graphs._run_static(1)),
        ("after 2 ms idle", idle(0.002)),
        ("after 50 ms idle", idle(0.05)),
        ("after 500 ms idle", idle(0.5)),
        ("back to back again", lambda: None),
    ):
        before = g.clock_power()
        event()
        runs = [round(g.replay_ms(graph1, 50), 4) for _ in range(6)]
        g.emit(
            "after_event_ms",
            case=name,
            runs=runs,
            clock_power_before=before,
            after=g.clock_power(),
        )

    # 1b. the engine graph with the engine's between-graph operations, added one at a time and
    # replayed back to back (no host in the loop): which of them the ~80 us goes with
    ids_host = torch.empty(1, dtype=torch.int64, pin_memory=True)
    patch = graphs.patch[:, :1]
    between = {
        "inputs copy": lambda: graphs._dev.copy_(graphs._host, non_blocking=True),
        "+ sampled-id patch": lambda: gather_scatter(graphs.tokens[0], patch, graphs.outputs[1][1]),
        "+ ids copy back and an event": lambda: (
            ids_host.copy_(graphs.outputs[1][1][:1], non_blocking=True),
            torch.cuda.Event().record(),
        ),
    }
    patch.zero_()  # row 0 <- the last sampled id (row 0)
    graphs.h_patch[:, :1] = 0
    ops: list = []
    times = {}
    for name, op in between.items():
        ops.append(op)

        def step(ops=tuple(ops)) -> None:
            for o in ops:
                o()
            graphs.graphs[1].replay()

        for _ in range(args.rounds):
            step()
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                step()
            z.record()
            z.synchronize()
            times.setdefault(name, []).append(a.elapsed_time(z) / 50)
    g.emit("back_to_back_with_ops_between_ms", **{k: med(v) for k, v in times.items()})
    core.abort_requests(list(core.scheduler.requests))
    _step_until(core, lambda: not core.has_unfinished_requests())

    # 2. inside the engine's loop
    events: list[tuple] = []
    replay = graphs.replay

    def timed(b: int, n: int):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = replay(b, n)
        z.record()
        events.append((a, z))
        return out

    graphs.replay = timed
    try:
        for trial in range(2):
            events.clear()
            add(args.steps)
            _step_until(core, lambda: not core.has_unfinished_requests())
            torch.cuda.synchronize()
            e = events[20:-5]
            g.emit(
                "in_loop_ms",
                trial=trial,
                graph=med([a.elapsed_time(z) for a, z in e]),
                period=med([e[i][0].elapsed_time(e[i + 1][0]) for i in range(len(e) - 1)]),
                gap=med([e[i][1].elapsed_time(e[i + 1][0]) for i in range(len(e) - 1)]),
                replays=len(events),
            )
    finally:
        graphs.replay = replay
    # and back to back again, on the last step's inputs
    runs = [round(g.replay_ms(graphs.graphs[1], 50), 4) for _ in range(4)]
    g.emit("back_to_back_after_the_loop_ms", runs=runs)


if __name__ == "__main__":
    main()
