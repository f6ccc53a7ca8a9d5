"""``fulcrum bench cold-start``: launch a server command N times; time it to ``/health`` and to
its first completed request, and record its peak memory.

Peak host memory is the largest sum of resident set sizes over the server process and its
descendants (read from ``/proc``, sampled every 50 ms). Peak GPU memory comes from
``nvidia-smi --query-compute-apps`` for the same processes, when ``nvidia-smi`` exists.
Each launch is ended with SIGTERM to its process group (SIGKILL after ``--stop-timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from fulcrum.bench.args import positive_float, positive_int
from fulcrum.bench.client import ServerError, normalise_base_url


def add_cold_start_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cold-start",
        help="Time a server from launch to /health and to its first answer.",
        description="Launch SERVER_CMD N times and report time to /health, time to the first "
        "completed request and peak memory.",
    )
    p.add_argument(
        "--server-cmd",
        required=True,
        help="Command that starts the server, e.g. 'fulcrum serve --port 8123'.",
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="Where that server listens (default http://127.0.0.1:8000).",
    )
    p.add_argument("-n", "--num-runs", type=positive_int, default=3, help="Launches (default 3).")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="Seconds to wait for /health and the first answer (default 600).",
    )
    p.add_argument(
        "--stop-timeout",
        type=positive_float,
        default=30.0,
        help="Seconds between SIGTERM and SIGKILL at shutdown (default 30).",
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="Endpoint of the first request (default completions).",
    )
    p.add_argument(
        "--model", default=None, help="Model name to send (default: the first one of /v1/models)."
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=8,
        help="Output tokens of the first request (default 8).",
    )
    p.add_argument("--result-file", default=None, help="Write the JSON results here.")
    p.set_defaults(func=run_cold_start)


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def _gpu_bytes(pids: list[int]) -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    want, total = set(pids), 0
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in want and parts[1].isdigit():
            total += int(parts[1]) * 2**20
    return total


class _MemorySampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop_event = pid, threading.Event()
        self.peak_rss, self.peak_gpu = 0, None

    def run(self) -> None:
        n = 0
        while not self.stop_event.wait(0.05):
            pids = _tree(self.pid)
            self.peak_rss = max(self.peak_rss, _rss_bytes(pids))
            if n % 10 == 0:
                gpu = _gpu_bytes(pids)
                if gpu is not None:
                    self.peak_gpu = max(self.peak_gpu or 0, gpu)
            n += 1


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [x.strip() for x in f.read().splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def one_launch(args: argparse.Namespace, base: str) -> dict[str, Any]:
    log = tempfile.NamedTemporaryFile(prefix="fulcrum-cold-start-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        shlex.split(args.server_cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    sampler = _MemorySampler(proc.pid)
    sampler.start()
    try:
        with httpx.Client(trust_env=False, timeout=args.timeout) as client:
            health = None
            while health is None:
                if proc.poll() is not None:
                    raise ServerError(
                        f"server exited with code {proc.returncode} before /health: {_last_line(log.name)}"
                    )
                if time.perf_counter() - t0 > args.timeout:
                    raise ServerError(f"server not healthy after {args.timeout:g} s.")
                try:
                    if client.get(base + "/health", timeout=2.0).status_code == 200:
                        health = time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                if health is None:
                    time.sleep(0.05)
            model = args.model or client.get(base + "/v1/models").json()["data"][0]["id"]
            if args.endpoint == "chat":
                url, body = (
                    base + "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Say hello."}]},
                )
            else:
                url, body = base + "/v1/completions", {"prompt": "Hello, my name is"}
            resp = client.post(url, json={**body, "model": model, "max_tokens": args.max_tokens})
            if resp.status_code != 200 or "choices" not in resp.json():
                raise ServerError(
                    f"first request failed: HTTP {resp.status_code} {resp.text[:120]}"
                )
            first = time.perf_counter() - t0
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ServerError(f"server at {base} did not answer as an OpenAI server: {e}") from None
    finally:
        sampler.stop_event.set()
        sampler.join()
        _stop(proc, args.stop_timeout)
        log.close()
        os.unlink(log.name)
    return {
        "time_to_health_s": health,
        "time_to_first_request_s": first,
        "peak_rss_bytes": sampler.peak_rss,
        "peak_gpu_memory_bytes": sampler.peak_gpu,
    }


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def run_cold_start(args: argparse.Namespace) -> int:
    try:
        base = normalise_base_url(args.base_url)
        runs = []
        for i in range(args.num_runs):
            r = one_launch(args, base)
            runs.append(r)
            gpu = (
                "n/a"
                if r["peak_gpu_memory_bytes"] is None
                else f"{r['peak_gpu_memory_bytes'] / 2**30:.2f} GiB"
            )
            print(
                f"run {i + 1}/{args.num_runs}: /health {r['time_to_health_s']:.2f} s, first request {r['time_to_first_request_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, peak GPU {gpu}"
            )
    except (ServerError, ValueError, OSError) as e:
        print(f"fulcrum bench cold-start: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    summary = {}
    for key in ("time_to_health_s", "time_to_first_request_s", "peak_rss_bytes"):
        vals = [r[key] for r in runs]
        summary[key] = {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)}
    print(
        "mean: /health {:.2f} s, first request {:.2f} s, peak RSS {:.2f} GiB".format(
            summary["time_to_health_s"]["mean"],
            summary["time_to_first_request_s"]["mean"],
            summary["peak_rss_bytes"]["max"] / 2**30,
        )
    )
    if args.result_file:
        doc = {
            "schema": "fulcrum.bench.cold_start/1",
            "server_cmd": args.server_cmd,
            "base_url": base,
            "runs": runs,
            "summary": summary,
        }
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"results: {args.result_file}")
    return 0
