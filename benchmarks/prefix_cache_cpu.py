"""Prefix cache on the CPU with the embedded SmolLM2-135M: prefix-heavy and unique traffic
(``--model llama-3.1-8b --device cuda``: a configs/ model on dummy weights on the GPU).

Prefix-heavy: G groups × R requests; each group shares a ~1,000-token system prompt, then a
64-token question; 64 output tokens (``ignore_eos``). All requests are submitted at once (offline);
TTFT is first-token time minus arrival. Unique: the same shapes with no shared prefix, to show
what the cache costs when nothing is shared.

    python benchmarks/prefix_cache_cpu.py [--groups 8] [--per-group 8] [--json out.json]
        [--only prefix-fcfs ...] [--repeat N] [--interleave] [--kv-cache-memory GIB]
        [--host-kv-cache-memory GIB]

``--interleave`` submits the groups' requests round-robin (g0, g1, ..., g0, g1, ...) instead of
group by group, and a small ``--kv-cache-memory`` keeps the cache from holding every system
prompt at once: the case where the scheduling order decides what stays cached (LPM vs FCFS),
and where a host tier under the cache (``prefix-host``) keeps what the device evicts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import time


def workload(groups: int, per_group: int, prefix_len: int, q_len: int, shared: bool, seed: int,
             interleave: bool = False):
    rng = random.Random(seed)
    prompts = []
    for _g in range(groups):
        prefix = [rng.randrange(100, 49000) for _ in range(prefix_len)]
        for _ in range(per_group):
            p = prefix if shared else [rng.randrange(100, 49000) for _ in range(prefix_len)]
            prompts.append(p + [rng.randrange(100, 49000) for _ in range(q_len)])
    if interleave:  # request r of every group, then r + 1 of every group, ...
        prompts = [prompts[g * per_group + r] for r in range(per_group) for g in range(groups)]
    return prompts


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(prompts, out_len: int, cache: bool, policy: str, kv_gib: float = 4.0,
        host_gib: float = 0.0, model: str | None = None, device: str = "cpu") -> dict:  # fmt: skip
    from fulcrum import LLM, SamplingParams

    extra = {"load_format": "dummy"} if model is not None and not os.path.exists(model) else {}
    llm = LLM(model, dtype="float32" if device == "cpu" else "bfloat16", device=device,
              kv_cache_memory=kv_gib, enable_prefix_caching=cache, schedule_policy=policy,
              host_kv_cache_memory=host_gib, **extra)  # fmt: skip
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    # Every step's batch, (request id, new tokens): two policies that schedule the same steps
    # get the same digest, so a throughput difference between them is not the policy's.
    sched, steps = llm.core.scheduler, []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        steps.append(tuple(zip(out.req_ids, out.num_scheduled_tokens, strict=True)))
        return out

    sched.schedule = recording_schedule
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    st = llm.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "cache": cache, "policy": policy, "seconds": dt, "output_tok_s": n_out / dt,
        "total_tok_s": (n_out + sum(map(len, prompts))) / dt,
        "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95),
        "hit_rate": st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]),
        "host_hit_rate": st["prefix_cache_host_hits"] / max(1, st["prefix_cache_queries"]),
        "steps": len(steps),
        "schedule_digest": hashlib.sha1(repr(steps).encode()).hexdigest()[:12],
    }


CASES = {  # name: (traffic, prefix cache, policy, host tier)
    "prefix-lpm": ("prefix-heavy", True, "lpm"),
    "prefix-fcfs": ("prefix-heavy", True, "fcfs"),
    "prefix-host": ("prefix-heavy", True, "fcfs", True),  # FCFS over --host-kv-cache-memory
    "prefix-nocache": ("prefix-heavy", False, "fcfs"),
    "unique-cache": ("unique", True, "fcfs"),
    "unique-nocache": ("unique", False, "fcfs"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8, help="Number of shared system prompts.")
    ap.add_argument("--per-group", type=int, default=8, help="Requests per system prompt.")
    ap.add_argument("--prefix-len", type=int, default=1000, help="System prompt tokens.")
    ap.add_argument("--question-len", type=int, default=64, help="Question tokens.")
    ap.add_argument("--output-len", type=int, default=64, help="Output tokens per request.")
    ap.add_argument("--seed", type=int, default=0, help="Workload seed.")
    ap.add_argument("--json", default=None, help="Write results here.")
    ap.add_argument("--only", choices=CASES, nargs="+", default=None,
                    help="Run only these cases (default: all).")
    ap.add_argument("--repeat", type=int, default=1, help="Runs of each case, one process.")
    ap.add_argument("--interleave", action="store_true",
                    help="Submit the groups' requests round-robin instead of group by group.")
    ap.add_argument("--kv-cache-memory", type=float, default=4.0,
                    help="KV pool in GiB (small: the cache cannot hold every system prompt).")
    ap.add_argument("--host-kv-cache-memory", type=float, default=2.0,
                    help="The host tier in GiB, for the prefix-host case.")
    ap.add_argument("--model", default=None,
                    help="A model directory, or a configs/ name run on dummy weights "
                         "(default: the embedded SmolLM2).")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16).")
    args = ap.parse_args()
    results = []
    for name in args.only or CASES:
        traffic, cache, policy, *host = CASES[name]
        prompts = workload(args.groups, args.per_group, args.prefix_len, args.question_len,
                           traffic == "prefix-heavy", args.seed, args.interleave)
        for i in range(args.repeat):
            host_gib = args.host_kv_cache_memory if host else 0.0
            r = run(prompts, args.output_len, cache, policy, args.kv_cache_memory, host_gib,
                    args.model, args.device)  # fmt: skip
            r.update(traffic=traffic, case=name, run=i)
            print(json.dumps(r), flush=True)
            results.append(r)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
