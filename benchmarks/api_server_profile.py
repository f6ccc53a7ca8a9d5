"""Profile the API server process alone, at GPU-like output rates, on any machine.

The real app (``build_app``: FastAPI, chat templates, tokenization, the output processor and
detokenizer, SSE) and the real process boundary (``AsyncEngine`` over ZMQ) run against a paced
engine core that needs no model: every ``--step-ms`` it emits one random token per running request
(ids across the embedded tokenizer's vocabulary, so detokenization does real work), which is what
the engine delivers at that step time. ``fulcrum bench serve`` drives it from another process with
streaming chat requests. The server process runs under cProfile; the script prints where its time
went, the client's figures, and the delay of each core message in the API process (the step trace's
``lag``), the measure that matters: a busy API process delays every stream.

    python benchmarks/api_server_profile.py [--conc 100] [--num-prompts 300] [--step-ms 15]
        [--input-len 1000] [--output-len 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from fulcrum.protocol import (  # noqa: E402
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)


class PacedCore:
    """One token per running request every ``step_ms`` (the engine's rate at that step time)."""

    def __init__(self, step_ms: float, vocab: int) -> None:
        self.step_s = step_ms / 1e3
        self.vocab = vocab
        self.max_model_len = 8192
        self.vocab_size = vocab
        self.running: dict[str, list[int]] = {}  # id -> [max_tokens, emitted]
        self.aborted: list[str] = []
        self.rng = random.Random(0)
        self.next_step = time.perf_counter()

    def add_request(self, req: EngineCoreRequest) -> None:
        self.running[req.request_id] = [req.sampling_params.max_tokens, 0]

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.aborted)

    def step(self) -> EngineCoreOutputs:
        self.next_step = max(self.next_step + self.step_s, time.perf_counter())
        time.sleep(max(0.0, self.next_step - time.perf_counter()))
        outs = [EngineCoreOutput(rid, 0, [], finish_reason="abort") for rid in self.aborted]
        self.aborted = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] >= st[0]
            tok = self.rng.randrange(100, self.vocab)
            outs.append(EngineCoreOutput(rid, 0, [tok], finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return EngineCoreOutputs(outputs=outs, stats=self.get_stats(), timestamp=time.time())

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.running), num_blocks_total=1 << 16,
                              num_blocks_free=1 << 16)

    def shutdown(self) -> None:
        pass


class PacedCoreFactory:
    def __init__(self, step_ms: float, vocab: int) -> None:
        self.step_ms, self.vocab = step_ms, vocab

    def __call__(self) -> PacedCore:
        return PacedCore(self.step_ms, self.vocab)


def serve(args: argparse.Namespace, port: int) -> None:
    """The server process: uvicorn on the real app, under cProfile until SIGTERM."""
    import signal

    import uvicorn

    from fulcrum.engine.async_engine import AsyncEngine
    from fulcrum.engine.output_processor import OutputProcessor
    from fulcrum.entrypoints.openai.api_server import DrainingServer, build_app
    from fulcrum.entrypoints.openai.serving_base import ServeOptions, ServerState
    from fulcrum.tokenizer import load_tokenizer

    state = ServerState(ServeOptions(served_model_names=["paced"], model_root="paced"))

    async def make_engine(metrics):  # noqa: ANN001, ANN202
        return await AsyncEngine.start(
            PacedCoreFactory(args.step_ms, 49152),
            OutputProcessor,
            load_tokenizer=lambda: load_tokenizer(args.tokenizer),
            max_model_len=8192,
            vocab_size=49152,
            stats_sink=metrics,
        )

    app = build_app(state, make_engine)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, lifespan="on")
    server = DrainingServer(config, state)
    prof = cProfile.Profile()

    def stop(*_: object) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    prof.enable()
    server.run()
    prof.disable()
    prof.dump_stats(os.path.join(args.out, "api.prof"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conc", type=int, default=100, help="Concurrent streams (default 100).")
    ap.add_argument("--num-prompts", type=int, default=300, help="Requests (default 300).")
    ap.add_argument("--step-ms", type=float, default=15.0, help="Paced step time (default 15).")
    ap.add_argument("--input-len", type=int, default=1000, help="Prompt tokens (default 1000).")
    ap.add_argument("--output-len", type=int, default=200, help="Output tokens (default 200).")
    ap.add_argument("--tokenizer", default=None, help="Tokenizer (default: the embedded one).")
    ap.add_argument("--out", default="/tmp/api_profile", help="Folder for the profile and trace.")
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.serve:
        serve(args, args.serve)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FULCRUM_STEP_TRACE=os.path.join(args.out, "trace"))
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--serve", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    result = os.path.join(args.out, "bench.json")
    cmd = [
        sys.executable, "-m", "fulcrum.entrypoints.cli", "bench", "serve", "--base-url", url,
        "--endpoint", "chat", "--num-prompts", str(args.num_prompts), "--max-concurrency",
        str(args.conc), "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
        "--disable-tqdm", "--random-input-len", str(args.input_len), "--random-output-len",
        str(args.output_len), "--extra-body", json.dumps({"return_token_ids": True}),
        "--result-file", result,
    ]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    try:
        subprocess.run(cmd, env=env, check=True)
    finally:
        server.terminate()
        server.wait(60)
    buf = io.StringIO()
    st = pstats.Stats(os.path.join(args.out, "api.prof"), stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    print(buf.getvalue())
    lags = [json.loads(x)["lag"] for x in open(os.path.join(args.out, "trace.api.jsonl"))
            if '"lag"' in x]
    lags.sort()
    print(f"core messages: {len(lags)}; lag p50 {1e3 * lags[len(lags) // 2]:.2f} ms, "
          f"p95 {1e3 * lags[int(0.95 * (len(lags) - 1))]:.2f} ms, max {1e3 * lags[-1]:.2f} ms")
    return 0


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    raise SystemExit(main())
