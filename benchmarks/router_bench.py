"""Router benchmark: prefix-heavy traffic over several `fulcrum serve` workers under cache_aware,
round_robin and least_load (workers' real prefix-cache hit rate, the router's estimate, TTFT
p50/p95, throughput), and the router's overhead with one worker (direct vs routed).

CPU, embedded model, small sizes (a few minutes):
    python benchmarks/router_bench.py --workers 3 --groups 6 --requests 96 --concurrency 8 \
        --serve-args "--max-model-len 1024 --kv-cache-memory 0.5" --overhead-requests 200 \
        --single-serve-args "--max-model-len 1024 --kv-cache-memory 1.5"
H200 (one GPU per worker would need CUDA_VISIBLE_DEVICES per worker; on one GPU run small
--gpu-memory-utilization per worker):
    python benchmarks/router_bench.py --workers 3 --groups 32 --requests 2000 --concurrency 64 \
        --serve-args "--model llama-3.1-8b --load-format dummy --gpu-memory-utilization 0.28" \
        --overhead-requests 3000 --overhead-concurrency 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from router.router_helpers import ROUTER_KEY, start_router  # noqa: E402
from server.srv_helpers import MODEL, start_server, stop_server  # noqa: E402

AUTH = {"authorization": f"Bearer {ROUTER_KEY}"}


def prompts(n: int, groups: int, prefix_words: int, seed: str) -> list[str]:
    rng = random.Random(seed)
    heads = [
        f"[{seed} group {g}] " + " ".join(f"fact{g}-{i}" for i in range(prefix_words))
        for g in range(groups)
    ]
    return [f"{rng.choice(heads)}\nQuestion {i}: summarise." for i in range(n)]


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, chunks = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            # the first chunk with text: a server may send the role alone before prefill ends
            choices = json.loads(line[6:]).get("choices") or [{}]
            if ttft is None and choices[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
    return ttft or 0.0, chunks


async def drive(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def task(t: str) -> tuple[float, int]:
            async with sem:
                return await one(client, url, t, max_tokens)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(task(t) for t in texts))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in res)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": 1000 * ttfts[int(0.95 * (len(ttfts) - 1))],
        "req_per_s": len(texts) / wall,
        "chunks_per_s": sum(r[1] for r in res) / wall,
    }


def cache_counts(servers) -> tuple[float, float]:
    q = h = 0.0
    for s in servers:
        m = s.metrics()
        q += m.get("fulcrum:prefix_cache_queries_total", m.get("fulcrum:prefix_cache_queries", 0))
        h += m.get("fulcrum:prefix_cache_hits_total", m.get("fulcrum:prefix_cache_hits", 0))
    return q, h


def estimated_hit_rate(router) -> float | None:
    for line in router.client.get("/metrics").text.splitlines():
        if line.startswith("fulcrum_router:cache_estimated_hit_rate"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=3, help="fulcrum serve workers to start.")
    ap.add_argument(
        "--serve-args", default="--max-model-len 1024", help="Extra flags for each worker."
    )
    ap.add_argument("--groups", type=int, default=6, help="Shared-prefix groups.")
    ap.add_argument("--prefix-words", type=int, default=120, help="Words in each group's prefix.")
    ap.add_argument("--requests", type=int, default=96, help="Requests per policy.")
    ap.add_argument("--concurrency", type=int, default=8, help="Requests in flight.")
    ap.add_argument("--max-tokens", type=int, default=8, help="Output tokens per request.")
    ap.add_argument("--policies", default="cache_aware,round_robin,least_load", help="Comma list.")
    ap.add_argument(
        "--single-serve-args",
        default=None,
        help="Also drive the same traffic straight at one worker started with these flags (give "
        "it the KV memory of all the workers together): the hit rate routing aims for.",
    )
    ap.add_argument("--overhead-requests", type=int, default=0, help="0 skips the overhead run.")
    ap.add_argument(
        "--overhead-concurrency", type=int, default=100, help="Overhead run's concurrency."
    )
    ap.add_argument("--json", default=None, help="Also write the results to this file.")
    args = ap.parse_args()
    serve_args = shlex.split(args.serve_args)
    tmp = tempfile.mkdtemp(prefix="router_bench_")
    dirs = [os.path.join(tmp, str(i)) for i in range(args.workers)]
    for d in dirs:
        os.makedirs(d)
    servers = [start_server(d, *serve_args) for d in dirs]
    results: dict = {"args": vars(args), "policies": {}}
    try:
        urls = [s.base_url for s in servers]
        for policy in args.policies.split(","):
            router = start_router(urls, "--policy", policy)
            try:
                q0, h0 = cache_counts(servers)
                texts = prompts(args.requests, args.groups, args.prefix_words, policy)
                r = asyncio.run(drive(router.base_url, texts, args.concurrency, args.max_tokens))
                q1, h1 = cache_counts(servers)
                r["worker_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                r["router_estimated_hit_rate"] = estimated_hit_rate(router)
                results["policies"][policy] = r
                print(policy, json.dumps(r), flush=True)
            finally:
                router.stop()
        if args.single_serve_args is not None:
            d = os.path.join(tmp, "single")
            os.makedirs(d)
            big = start_server(d, *shlex.split(args.single_serve_args))
            try:
                texts = prompts(args.requests, args.groups, args.prefix_words, "single")
                r = asyncio.run(drive(big.base_url, texts, args.concurrency, args.max_tokens))
                q, h = cache_counts([big])
                r["worker_hit_rate"] = h / q if q else 0.0
                results["single_worker"] = r
                print("single_worker", json.dumps(r), flush=True)
            finally:
                stop_server(big)
        if args.overhead_requests:
            texts = prompts(args.overhead_requests, args.overhead_requests, 8, "overhead")
            direct = asyncio.run(drive(urls[0], texts, args.overhead_concurrency, args.max_tokens))
            router = start_router(urls[:1], "--policy", "round_robin")
            try:
                texts = prompts(args.overhead_requests, args.overhead_requests, 8, "overhead2")
                routed = asyncio.run(
                    drive(router.base_url, texts, args.overhead_concurrency, args.max_tokens)
                )
            finally:
                router.stop()
            results["overhead"] = {
                "direct": direct,
                "routed": routed,
                "added_ttft_p50_ms": routed["ttft_p50_ms"] - direct["ttft_p50_ms"],
                "throughput_ratio": routed["req_per_s"] / direct["req_per_s"],
            }
            print("overhead", json.dumps(results["overhead"]), flush=True)
    finally:
        for s in servers:
            stop_server(s)
        subprocess.run(["rm", "-rf", tmp], check=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
