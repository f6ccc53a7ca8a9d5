"""The serving benchmark on one GPU: `fulcrum bench serve` against `fulcrum serve`, both started here.

For each server configuration (dtype: bf16 or FP8 weights + FP8 KV; prefix cache on or off;
scheduling policy) the script starts ``fulcrum serve --load-format dummy`` on a model with Llama-3.1-8B
shapes and the embedded model's tokenizer (``configs/llama-3.1-8b-smoltok.json``), times its cold start
(process start to the first answered request), then runs streaming chat completions at each concurrency
on two kinds of traffic:

* ``unique``: 1,000-token random prompts, 200 tokens out;
* ``prefix``: 4 shared 2,000-token prefixes, each request adding 100 tokens of its own, 200 out.

Every request sets ``ignore_eos`` and ``return_token_ids``, so each generated token reaches the client
as its own chunk and TTFT/ITL are per token even when a token has no text. Each point uses its own seed:
"unique" prompts never repeat across points. GPU memory is polled with nvidia-smi while each server
runs (peak per configuration). ``--offline`` also runs the unique workload through ``LLM.generate``
with ``max_num_seqs`` equal to the highest concurrency, in a fresh process and the first fulcrum
configuration's dtype, for the server's share of the offline engine's throughput. Results: one
JSON per point (``fulcrum bench serve``'s format) and ``summary.json`` under ``--out``;
``--plot-only`` draws the overlays from them (matplotlib).

    python benchmarks/server_h200.py --out DIR [--configs bf16:on,bf16:off,fp8:on,fp8:off]
        [--traffic unique,prefix] [--conc 1,10,50,100] [--offline] [--trace] [--deadline S]

``--via-router`` also runs every point through ``fulcrum router`` (round robin, one worker) in front
of the same server, with its own seed, for the router's added TTFT and its share of the throughput
(``<point>-router`` in ``summary.json``).

``--trace`` sets ``FULCRUM_STEP_TRACE`` for the servers (per-step timelines, see
``fulcrum.engine.step_trace``) and summarises where slow tokens spent their time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
# requests per point: enough for two or more waves of the concurrency, small at c=1
PROMPTS = {1: 8, 10: 60, 50: 200, 100: 300}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_src(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class GpuMemoryPoller:
    """Peak used GPU memory (MiB) from nvidia-smi, polled every 0.5 s."""

    def __init__(self) -> None:
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5,
                ).stdout
                self.peak_mib = max(self.peak_mib, float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(0.5)

    def __enter__(self) -> GpuMemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def server_command(args: argparse.Namespace, cfg: str, port: int) -> tuple[list[str], dict]:
    """``DTYPE:CACHE[:POLICY[:BUDGET]]`` for fulcrum; ``vllm:DTYPE:CACHE`` for the peer."""
    if cfg.startswith("vllm"):
        _, dtype, cache = (cfg.split(":") + ["bf16", "on"])[:3]
        cmd = [
            "python3", "-m", "vllm.entrypoints.cli.main", "serve", args.vllm_model,
            "--served-model-name", "llama8b", "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log",
            "--enable-prefix-caching" if cache == "on" else "--no-enable-prefix-caching",
        ]
        if dtype == "fp8":
            cmd += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
        env = dict(os.environ, PYTHONPATH=args.vllm_site, VLLM_USE_FLASHINFER_SAMPLER="0",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
        return cmd, env
    dtype, cache, *rest = cfg.split(":")
    policy = rest[0] if rest else "fcfs"
    cmd = [
        sys.executable, "-m", "fulcrum.entrypoints.cli", "serve",
        "--model", args.model, "--load-format", "dummy", "--dtype", "bfloat16",
        "--port", str(port), "--max-model-len", "4096", "--log-level", "warning",
        "--no-access-log", "--schedule-policy", policy, *tokenizer_flag(args, cfg),
        "--enable-prefix-caching" if cache == "on" else "--no-enable-prefix-caching",
    ]
    if len(rest) > 1:
        cmd += ["--max-num-batched-tokens", rest[1]]
    if dtype == "fp8":
        cmd += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    cmd += args.serve_args.split()
    return cmd, env_with_src()


def start_server(args: argparse.Namespace, cfg: str, log_path: str, trace: str | None):
    port = free_port()
    cmd, env = server_command(args, cfg, port)
    if trace and not cfg.startswith("vllm"):
        env["FULCRUM_STEP_TRACE"] = trace
    return launch(cmd, env, port, log_path, f"server {cfg}")


def start_router(worker: str, log_path: str):
    """``fulcrum router`` in front of one worker, once a completion through it is answered."""
    port = free_port()
    cmd = [sys.executable, "-m", "fulcrum.entrypoints.cli", "router", "--port", str(port),
           "--worker", worker, "--policy", "round_robin", "--log-level", "warning"]
    return launch(cmd, env_with_src(), port, log_path, "router")[:3]


def launch(cmd: list[str], env: dict, port: int, log_path: str, what: str):
    """Start ``cmd`` (serving on ``port``); (process, log, URL, seconds until a one-token
    completion is answered)."""
    t0 = time.perf_counter()
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    # its own session: vLLM's engine runs in a child process, stopped with the group
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                name = json.load(r)["data"][0]["id"]
            body = json.dumps({"model": name, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
            req = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status == 200:
                    return proc, log, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{what} not ready in 600 s")


def stop_server(proc: subprocess.Popen, log) -> None:
    def signal_group(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    signal_group(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    signal_group(signal.SIGKILL)
    proc.wait(10)
    log.close()


def tokenizer_flag(args: argparse.Namespace, cfg: str = "") -> list[str]:
    if cfg.startswith("vllm"):
        return ["--tokenizer", args.vllm_model]
    return ["--tokenizer", args.tokenizer] if args.tokenizer else []


def bench_point(
    args: argparse.Namespace, cfg: str, url: str, traffic: str, conc: int, seed: int, result: str,
    log_path: str,
) -> dict:
    n = args.num_prompts or PROMPTS.get(conc, max(2 * conc, 8))
    cmd = [
        sys.executable, "-m", "fulcrum.entrypoints.cli", "bench", "serve",
        "--base-url", url, "--endpoint", "chat", "--num-prompts", str(n),
        "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
        "--num-warmups", "2", "--seed", str(seed), "--disable-tqdm",
        "--extra-body", json.dumps({"return_token_ids": True}),
        "--result-file", result, "--label", os.path.basename(result)[:-5], *tokenizer_flag(args, cfg),
    ]
    if traffic == "unique":
        cmd += [
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
        ]
    else:
        cmd += [
            "--dataset-name", "prefix-repetition", "--prefix-num-prefixes", "4",
            "--prefix-len", "2000", "--prefix-suffix-len", "100",
            "--prefix-output-len", str(args.output_len),
        ]
    with open(log_path, "a") as log:
        rc = subprocess.run(cmd, env=env_with_src(), stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"bench {traffic} c={conc} failed (rc {rc}); see {log_path}")
    with open(result) as fh:
        doc = json.load(fh)
    return doc["points"][0]


def point_row(p: dict) -> dict:
    server = p.get("server") or {}
    return {
        "out_tok_s": p["output_throughput"],
        "total_tok_s": p["total_token_throughput"],
        "ttft_p50_ms": p["ttft_ms"]["p50"],
        "ttft_p95_ms": p["ttft_ms"]["p95"],
        "tpot_p50_ms": p["tpot_ms"]["p50"],
        "itl_p95_ms": p["itl_ms"]["p95"],
        "hit_rate": server.get("prefix_cache_hit_rate"),
        "completed": p["completed"],
        "failed": p.get("failed", 0),
    }


def offline_point(args: argparse.Namespace, conc: int, path: str, dtype: str = "bf16") -> dict:
    """The unique workload through LLM.generate in its own process (seeded token-id prompts),
    in ``dtype`` (bf16, or fp8: FP8 weights and KV cache, as the server's fp8 configurations)."""
    n = PROMPTS.get(conc, 2 * conc)
    fp8 = ', quantization="fp8", kv_cache_dtype="fp8"' if dtype == "fp8" else ""
    code = f"""
import json, random, time
from fulcrum import LLM, SamplingParams
llm = LLM({args.model!r}, tokenizer={args.tokenizer!r}, load_format="dummy", dtype="bfloat16",
          max_model_len=4096,
          max_num_seqs={conc}, enable_prefix_caching=False{fp8})
rng = random.Random(7)
prompts = [[rng.randrange(100, 40000) for _ in range(1000)] for _ in range({n} + 8)]
sp = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], sp, use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts[8:], sp, use_tqdm=False)
dt = time.perf_counter() - t0
n_out = sum(len(o.outputs[0].token_ids) for o in outs)
json.dump({{"requests": {n}, "seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
           "total_tok_s": (n_out + 1000 * {n}) / dt}}, open({path!r}, "w"))
"""
    subprocess.run([sys.executable, "-c", code], env=env_with_src(), check=True)
    with open(path) as fh:
        return json.load(fh)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarise_trace(prefix: str) -> dict:
    """Step durations, loop gaps, the API's delay and GC pauses from one server's trace files."""
    out: dict = {}
    for role in ("core", "api"):
        paths = sorted(glob.glob(f"{prefix}.{role}*.jsonl"))  # api, api1, ... per API process
        if not paths:
            continue
        rows = [json.loads(line) for path in paths for line in open(path)]
        gcs = [r for r in rows if "gc" in r]
        steps = [r for r in rows if "gc" not in r]
        d: dict = {
            "gc_pauses": len(gcs),
            "gc_ms_p99": 1e3 * pct([r["dur"] for r in gcs], 99),
            "gc_ms_max": 1e3 * max((r["dur"] for r in gcs), default=0.0),
            "gc_over_10ms": sum(r["dur"] > 0.01 for r in gcs),
        }
        if role == "core":
            dur = [r["step"] for r in steps]
            gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False)]
            d.update(
                steps=len(steps),
                step_ms_p50=1e3 * pct(dur, 50),
                step_ms_p95=1e3 * pct(dur, 95),
                step_ms_max=1e3 * max(dur, default=0.0),
                period_ms_p95=1e3 * pct(gaps, 95),
                drain_ms_p99=1e3 * pct([r["drain"] for r in steps], 99),
                push_ms_p99=1e3 * pct([r["push"] for r in steps], 99),
            )
            slow = [r for r in steps if r["step"] > 0.02]
            d["slow_steps"] = len(slow)
            d["slow_with_new_requests"] = sum(r["new"] > 0 for r in slow)
            d["slow_tokens_p50"] = pct([r["tokens"] for r in slow], 50)
            d["examples"] = slow[:8]
        else:
            lag = [r["lag"] for r in steps]
            d.update(
                messages=len(steps),
                lag_ms_p50=1e3 * pct(lag, 50),
                lag_ms_p95=1e3 * pct(lag, 95),
                lag_ms_max=1e3 * max(lag, default=0.0),
            )
        out[role] = d
    return out


def plot_overlay(out: str) -> list[str]:
    """One PNG per traffic kind under ``out``: every configuration's points as one line."""
    sys.path.insert(0, SRC)
    from fulcrum.bench.plot import plot_results

    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    written = []
    for traffic in ("unique", "prefix"):
        docs = []
        for cfg in summary["configs"]:
            tag = cfg.replace(":", "-")
            pts = []
            for path in sorted(glob.glob(os.path.join(out, f"{tag}-{traffic}-c*.json"))):
                with open(path) as fh:
                    pts += json.load(fh)["points"]
            if pts:
                docs.append({"label": cfg, "points": pts})
        if docs:
            path = os.path.join(out, f"{traffic}.png")
            plot_results(docs, path, title=f"{summary['model']}, {traffic} traffic, through the server")
            written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="Folder for the results.")
    ap.add_argument("--model", default="llama-3.1-8b-smoltok", help="configs/ name (dummy weights).")
    ap.add_argument(
        "--configs", default="bf16:on,bf16:off,fp8:on,fp8:off",
        help="Comma list of DTYPE:CACHE[:POLICY[:BUDGET]] (bf16|fp8, on|off, fcfs|lpm, a "
        "max_num_batched_tokens), or vllm[:DTYPE:CACHE] for the peer (needs --vllm-model).",
    )
    ap.add_argument(
        "--vllm-model", default=None,
        help="The peer's model folder (config.json + tokenizer: ../shared/peers/vllm's llama8b-smoltok).",
    )
    ap.add_argument(
        "--vllm-site", default="/tmp/vsite", help="PYTHONPATH holding the unpacked vLLM (install.sh SITE).",
    )
    ap.add_argument(
        "--tokenizer", default=None,
        help="Tokenizer folder for server and client (default: the model's, i.e. the embedded one).",
    )
    ap.add_argument(
        "--serve-args", default="", help="Extra `fulcrum serve` flags for every server, one string."
    )
    ap.add_argument("--traffic", default="unique,prefix", help="Comma list: unique, prefix.")
    ap.add_argument("--conc", default="1,10,50,100", help="Comma list of concurrencies.")
    ap.add_argument("--input-len", type=int, default=1000, help="unique: prompt tokens (1000).")
    ap.add_argument("--output-len", type=int, default=200, help="Output tokens (default 200).")
    ap.add_argument("--num-prompts", type=int, default=0, help="Requests per point (default: by c).")
    ap.add_argument("--offline", action="store_true", help="Also run the offline engine (unique).")
    ap.add_argument("--trace", action="store_true", help="Step traces of the servers.")
    ap.add_argument(
        "--via-router", action="store_true",
        help="Also run each point through `fulcrum router` in front of the same fulcrum server.",
    )
    ap.add_argument("--deadline", type=float, default=0, help="Skip points after this many s.")
    ap.add_argument(
        "--plot-only", action="store_true",
        help="Only draw the overlay plots (unique.png, prefix.png) from the results in --out.",
    )
    args = ap.parse_args()
    # A SIGTERM (`timeout`) unwinds through the finally blocks that stop the servers and the
    # router, which run in sessions of their own and would otherwise keep the GPU's memory.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.plot_only:
        print("\n".join(plot_overlay(args.out)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()
    concs = [int(c) for c in args.conc.split(",")]
    summary: dict = {"model": args.model, "configs": {}}
    sum_path = os.path.join(args.out, "summary.json")
    for ci, cfg in enumerate(args.configs.split(",")):
        if args.deadline and time.monotonic() - t_start > args.deadline:
            print(f"deadline: skipping {cfg}", flush=True)
            continue
        tag = cfg.replace(":", "-")
        trace = os.path.join(args.out, "trace", tag) if args.trace else None
        entry: dict = {"points": {}}
        summary["configs"][cfg] = entry
        with GpuMemoryPoller() as mem:
            proc, log, url, cold = start_server(args, cfg, os.path.join(args.out, f"{tag}.log"), trace)
            entry["cold_start_s"] = cold
            print(f"{cfg}: ready in {cold:.1f} s", flush=True)
            router = None
            try:
                if args.via_router and not cfg.startswith("vllm"):
                    router = start_router(url, os.path.join(args.out, f"{tag}-router.log"))
                for ti, traffic in enumerate(args.traffic.split(",")):
                    for conc in concs:
                        if args.deadline and time.monotonic() - t_start > args.deadline:
                            break
                        seed = 1000 * conc + 100 * ti + ci
                        runs = [("", url, seed)]
                        if router is not None:  # same traffic shape, its own prompts
                            runs.append(("-router", router[2], seed + 50))
                        for suffix, base, sd in runs:
                            res = os.path.join(args.out, f"{tag}-{traffic}-c{conc}{suffix}.json")
                            p = bench_point(args, cfg, base, traffic, conc, sd, res,
                                            os.path.join(args.out, "bench.log"))
                            row = point_row(p)
                            entry["points"][f"{traffic}-c{conc}{suffix}"] = row
                            print(f"{cfg} {traffic} c={conc}{suffix}: {json.dumps(row)}", flush=True)
                            json.dump(summary, open(sum_path, "w"), indent=1)
            finally:
                if router is not None:
                    stop_server(router[0], router[1])
                stop_server(proc, log)
        entry["peak_gpu_mib"] = mem.peak_mib
        if trace:
            entry["trace"] = summarise_trace(trace)
            print(json.dumps(entry["trace"], indent=1), flush=True)
        json.dump(summary, open(sum_path, "w"), indent=1)
    if args.offline and not (args.deadline and time.monotonic() - t_start > args.deadline):
        top = max(concs)
        # the offline run matches the first fulcrum configuration's dtype
        dtype = next((c.split(":")[0] for c in args.configs.split(",") if not c.startswith("vllm")),
                     "bf16")
        summary["offline"] = offline_point(args, top, os.path.join(args.out, "offline.json"), dtype)
        summary["offline"]["dtype"] = dtype
        print(f"offline c={top}: {json.dumps(summary['offline'])}", flush=True)
        json.dump(summary, open(sum_path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
