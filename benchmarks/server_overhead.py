"""Server overhead on the CPU: the engine benchmark's workload through HTTP vs the offline API.

Workload: ``engine_cpu.workload`` (seeded; N requests of random token ids, prompt lengths in
[32, 512], outputs in [16, 256], ``ignore_eos``, greedy). The offline run is ``LLM.generate`` with
every request submitted at once; the server run starts ``fulcrum serve`` with the same engine
flags and streams the same requests through ``/v1/completions`` (token-id prompts) at a
concurrency of 64. Reported: output tokens/s of both and their ratio (target >= 0.90), then TTFT
and ITL p50/p95 at concurrency 1, 8 and 64 (c=1 and c=8 on the first ``--latency-requests``).

    python benchmarks/server_overhead.py [--num-requests 64] [--latency-requests 16] [--json out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(ROOT, "src")]

from engine_cpu import run_fulcrum, workload  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def engine_flags(args: argparse.Namespace) -> list[str]:
    # The same engine configuration as engine_cpu.run_fulcrum.
    return [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        "4",
    ]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "fulcrum.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *engine_flags(args),
    ]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become ready")


async def run_http(url: str, reqs: list[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    import httpx

    from fulcrum.bench.client import Endpoint, send_request

    ep = Endpoint(url, MODEL)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def one(prompt: list[int], out: int) -> Any:
            async with sem:
                payload = {
                    "prompt": prompt,
                    "max_tokens": out,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                return await send_request(client, ep, "completions", payload, len(prompt))

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(p, o) for p, o in reqs])
        dt = time.perf_counter() - t0
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} request(s) failed, first: {failed[0]}")
    n_out = sum(r.output_len for r in results)
    assert n_out == sum(o for _, o in reqs), (n_out, sum(o for _, o in reqs))
    ttft = [r.ttft for r in results]
    itl = [x for r in results for x in r.itl]
    return {
        "concurrency": concurrency,
        "requests": len(reqs),
        "seconds": dt,
        "output_tokens": n_out,
        "output_tok_s": n_out / dt,
        "ttft_p50_ms": 1e3 * pct(ttft, 50),
        "ttft_p95_ms": 1e3 * pct(ttft, 95),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p95_ms": 1e3 * pct(itl, 95),
    }


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64, help="Requests in the workload.")
    ap.add_argument(
        "--latency-requests",
        type=int,
        default=16,
        help="Requests (the workload's first) for the concurrency 1 and 8 runs.",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="Step budget.")
    ap.add_argument("--seed", type=int, default=0, help="Workload seed.")
    ap.add_argument("--skip-offline", action="store_true", help="Only run the server side.")
    ap.add_argument("--json", default=None, help="Write the results to this file.")
    args = ap.parse_args()
    reqs = workload(args.num_requests, args.seed)
    results: dict[str, Any] = {
        "workload": {
            "num_requests": len(reqs),
            "seed": args.seed,
            "output_tokens": sum(o for _, o in reqs),
        }
    }
    if not args.skip_offline:
        results["offline"] = run_fulcrum(reqs, args)
        print(json.dumps(results["offline"]), flush=True)
        import gc

        gc.collect()
    proc, url = start_server(args)
    try:
        asyncio.run(run_http(url, reqs[:2], 2))  # warm-up
        runs = [asyncio.run(run_http(url, reqs, 64))]
        print(json.dumps(runs[-1]), flush=True)
        for c in (1, 8):
            runs.append(asyncio.run(run_http(url, reqs[: args.latency_requests], c)))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)
    results["server"] = runs
    if "offline" in results:
        ratio = runs[0]["output_tok_s"] / results["offline"]["output_tok_s"]
        results["throughput_ratio"] = ratio
        print(f"server/offline throughput at concurrency 64: {ratio:.3f} (target >= 0.90)")
    print(f"{'c':>3} {'TTFT p50':>10} {'TTFT p95':>10} {'ITL p50':>9} {'ITL p95':>9}  (ms)")
    for r in sorted(runs, key=lambda r: r["concurrency"]):
        print(
            f"{r['concurrency']:>3} {r['ttft_p50_ms']:>10.1f} {r['ttft_p95_ms']:>10.1f} "
            f"{r['itl_p50_ms']:>9.1f} {r['itl_p95_ms']:>9.1f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
