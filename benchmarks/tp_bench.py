"""Tensor-parallel throughput and ITL on CUDA: Llama-3.1-8B / Llama-3.3-70B with dummy weights
at tp 1, 2, 4, 8 (each size in a fresh process, skipped where the GPUs are too few or the
model does not fit).

Per size: cold start (LLM construction: spawn, shard load, KV profiling, graph capture),
offline throughput of N requests (random ids, ``--input-len`` in / ``--output-len`` out,
``ignore_eos``), batch-1 ITL at a ``--input-len`` context (the mean gap between tokens of
one request: (time of 1 + k tokens - time of 1 token) / k), and GPU 0's memory in use after
start-up and after the run against the ``gpu_memory_utilization`` budget (KV tokens and graph
memory beside it).

    python benchmarks/tp_bench.py --model llama-3.1-8b --tp 1 2 4 8 [--num-requests 1000]
    python benchmarks/tp_bench.py --model llama-3.3-70b --tp 2 4 8 --json tp70b.json

``--src A B``: the same sizes from each of several source trees (each a folder holding ``src/``
and ``configs/``, e.g. a ``git worktree`` of an older commit), one after the other in this run:
tp=1 before and after a change. At tp=1 no ``tensor_parallel_size`` is passed, so a tree from
before tensor parallelism runs too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time


def one(args: argparse.Namespace) -> dict:
    from fulcrum import LLM, SamplingParams

    t0 = time.perf_counter()
    tp = {} if args.one == 1 else {"tensor_parallel_size": args.one}
    llm = LLM(
        args.model, load_format="dummy", **tp,
        max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len + 8,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    cold = time.perf_counter() - t0
    started = _memory(llm)
    rng = random.Random(0)
    vocab = llm.config.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(args.input_len)]

    def timed(prompts, n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    timed([prompt()], 8)  # warm-up
    p = prompt()
    k = 256
    itl = (timed([p], 1 + k) - timed([p], 1)) / k
    reqs = [prompt() for _ in range(args.num_requests)]
    dt = timed(reqs, args.output_len)
    out = {
        "model": args.model, "tp": args.one, "quantization": args.quantization,
        "cold_start_s": round(cold, 2), "itl_ms": round(itl * 1e3, 3),
        "throughput_tok_s": round(args.num_requests * args.output_len / dt, 1),
        "requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        **started, "gpu0_used_gib_after_run": _memory(llm)["gpu0_used_gib"],
    }  # fmt: skip
    llm.core.shutdown()
    return out


def _memory(llm) -> dict:
    """GPU 0's memory in use (CUDA's view: every allocation and cache of this process), the
    budget ``gpu_memory_utilization`` sets, the KV pool and (one rank) the graphs' share."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    runner = getattr(llm.core, "runner", None)
    util = llm.config.cache_config.gpu_memory_utilization
    return {
        "gpu0_used_gib": round((total - free) / 2**30, 2),
        "budget_gib": round(total * util / 2**30, 2),
        "kv_tokens": llm.core.num_kv_tokens,
        "graph_memory_mib": {k: round(v / 2**20) for k, v in getattr(runner, "graph_memory", {}).items()},
    }


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _label(tree: str) -> str:
    """The commit in the tree's ``COMMIT`` file (written beside a ``git archive`` export), else
    the commit of a tree that is its own git checkout or worktree, else its folder name (an
    export inside another checkout must not take that checkout's commit)."""
    stamp = os.path.join(tree, "COMMIT")
    if os.path.exists(stamp):
        return open(stamp).read().strip()
    proc = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--show-toplevel", "--short", "HEAD"],
        capture_output=True, text=True,
    )  # fmt: skip
    lines = proc.stdout.split()
    if proc.returncode == 0 and len(lines) == 2 and os.path.samefile(lines[0], tree):
        return lines[1]
    return os.path.basename(tree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a configs/ name (dummy weights)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--src", nargs="+", default=[REPO],
        help="source trees to run (folders holding src/ and configs/; default: this checkout)",
    )
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one tp size
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    import torch

    rows = []
    for tree in args.src:
        tree = os.path.abspath(tree)
        rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) != os.path.join(REPO, "src")]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(tree, "src"), *rest]))
        env.pop("FULCRUM_CONFIGS_DIR", None)  # each tree reads its own configs/
        for tp in args.tp:
            if tp > torch.cuda.device_count():
                print(f"tp={tp}: skipped ({torch.cuda.device_count()} GPUs)")
                continue
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(tp)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not found:
                print(f"{tree} tp={tp}: failed (code {proc.returncode})\n{proc.stderr[-3000:]}")
                continue
            rows.append(dict(json.loads(found[-1][7:]), src=_label(tree)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
