"""Sustained mixed traffic through ``fulcrum serve``: is anything left behind?

Starts the server on the embedded model (or ``--serve-args``), then runs ``--rounds`` rounds of
``--requests`` chat requests at ``--concurrency`` with the official client, cycling through eight
kinds: plain, streamed, a stream closed after three chunks (an abort), ``n = 3`` sampled, stop
strings, a JSON schema, a client timeout while the server still generates (a disconnect), and a
request the server refuses (400). After each round (and a short pause) it reads ``/metrics`` and
the resident memory of the server's processes. What should hold: no client errors other than the
expected ones, no running or waiting request and no KV block in use between rounds, and memory
flat after the first round (which warms caches).

    python benchmarks/server_soak.py [--rounds 8] [--requests 240] [--concurrency 32]
        [--serve-args "--max-num-seqs 64"] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import time
import urllib.request
from typing import Any

from openai import AsyncOpenAI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_h200 import env_with_src, free_port, launch, stop_server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
    "required": ["a", "b"],
}
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def read_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"fulcrum:([a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) in GAUGES:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith("VmRSS:"))


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids + [g for k in kids for g in _children(k)]


def rss_mib(pid: int) -> dict[str, int]:
    """Resident MiB of the server (``api``) and its children (the largest is the engine core),
    from ``/proc`` (Linux)."""
    out = {"api": _rss(pid)}
    for i, kid in enumerate(sorted(_children(pid), key=lambda k: -_rss(k))):
        out["core" if i == 0 else f"child{i}"] = _rss(kid)
    return out


async def one(c: AsyncOpenAI, model: str, i: int, rng: random.Random) -> str | None:
    """The i-th request of a round (its kind is ``i % 8``); an unexpected error's text."""
    msgs = [{"role": "user", "content": f"Request {i}: a short fact about {rng.randint(0, 999)}."}]
    kw: dict[str, Any] = dict(model=model, messages=msgs)
    kind = i % 8
    try:
        if kind == 0:
            await c.chat.completions.create(**kw, max_tokens=16)
        elif kind == 1:
            async for _ in await c.chat.completions.create(**kw, max_tokens=24, stream=True):
                pass
        elif kind == 2:  # the client walks away mid-stream
            stream = await c.chat.completions.create(**kw, max_tokens=200, stream=True)
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    await stream.close()
                    break
        elif kind == 3:
            await c.chat.completions.create(**kw, max_tokens=12, n=3, temperature=0.8)
        elif kind == 4:
            await c.chat.completions.create(**kw, max_tokens=40, stop=[".", "\n"])
        elif kind == 5:
            rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
            await c.chat.completions.create(**kw, max_tokens=40, response_format=rf)
        elif kind == 6:  # a client timeout: it disconnects while the server generates
            try:
                fast = c.with_options(timeout=0.3, max_retries=0)
                await fast.chat.completions.create(**kw, max_tokens=300)
            except Exception:
                pass
        else:
            try:
                await c.chat.completions.create(**kw, max_tokens=-1)
                return "a bad request was answered"
            except Exception as e:
                if getattr(e, "status_code", None) != 400:
                    return f"kind {kind}, a bad request: {e!r}"[:200]
    except Exception as e:
        return f"kind {kind}: {e!r}"[:200]
    return None


async def run_round(
    client: AsyncOpenAI, model: str, args: argparse.Namespace, rng: random.Random
) -> list[str]:
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> str | None:
        async with sem:
            return await one(client, model, i, rng)

    return [e for e in await asyncio.gather(*map(limited, range(args.requests))) if e]


async def soak(args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    cmd = [sys.executable, "-m", "fulcrum.entrypoints.cli", "serve", "--port", str(port)]
    server, log, url, _ = launch(
        cmd + shlex.split(args.serve_args), env_with_src(), port, args.log, "fulcrum serve"
    )
    rows = []
    try:
        client = AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout
        )
        model = (await client.models.list()).data[0].id
        print(f"started: RSS MiB {rss_mib(server.pid)}", flush=True)
        for r in range(args.rounds):
            t = time.time()
            errors = await run_round(client, model, args, random.Random(r))
            wall = time.time() - t
            await asyncio.sleep(2)  # aborts and disconnects reach the core
            row = dict(round=r, wall_s=round(wall, 1), errors=errors, **read_metrics(url),
                       rss_mib=rss_mib(server.pid))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_server(server, log)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds of requests")
    p.add_argument("--requests", type=int, default=240, help="requests per round")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--serve-args", default="", help="extra `fulcrum serve` flags, one string")
    p.add_argument("--timeout", type=float, default=600, help="client timeout of a request (s)")
    p.add_argument("--log", default="/tmp/fulcrum_soak_server.log", help="the server's log file")
    p.add_argument("--json", help="write the per-round rows here")
    args = p.parse_args()
    rows = asyncio.run(soak(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    core = [r["rss_mib"].get("core", 0) for r in rows]
    left = [r for r in rows if r.get("num_requests_running") or r.get("num_requests_waiting")]
    print(f"errors {sum(len(r['errors']) for r in rows)}; rounds with requests left {len(left)}; "
          f"core RSS MiB after round 1 .. last: {core[1] if len(core) > 1 else '-'} .. {core[-1]}")  # fmt: skip


if __name__ == "__main__":
    main()
