"""``fulcrum bench serve``: load-test any OpenAI-compatible server and report vLLM's figures."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import itertools
import json
import os
import sys
from typing import Any

import httpx

from fulcrum.bench.args import (
    add_dataset_args,
    build_sessions,
    concurrency_list,
    dataset_params,
    non_negative_int,
    positive_float,
    rate_list,
)
from fulcrum.bench.client import Endpoint, ServerError, list_models, normalise_base_url
from fulcrum.bench.datasets import Session, Turn
from fulcrum.bench.metrics import PointMetrics, compute_metrics, parse_slos
from fulcrum.bench.report import point_block, read_results, summary_table, write_results
from fulcrum.bench.runner import LoadConfig, run_sessions
from fulcrum.bench.server_metrics import MetricsScraper


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="Load-test an OpenAI-compatible server (fulcrum, vLLM, SGLang).",
        description="Send a seeded workload to an OpenAI-compatible server and report "
        "throughput, TTFT, TPOT, ITL and end-to-end latency (vLLM's definitions).",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="Server URL, with or without /v1 (default http://127.0.0.1:8000).",
    )
    s.add_argument(
        "--endpoint",
        choices=("completions", "chat", "embeddings"),
        default="completions",
        help="OpenAI endpoint to call (default completions); embeddings: each prompt embedded, "
        "its latency reported as TTFT, nothing generated.",
    )
    s.add_argument(
        "--model", default=None, help="Model name to send (default: the first one of /v1/models)."
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer token (default: $OPENAI_API_KEY).",
    )
    s.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="Seconds before one request counts as failed (default 600).",
    )
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--max-concurrency",
        type=concurrency_list,
        default=[None],
        help="Requests in flight at most; a comma list sweeps, e.g. 1,10,50,100 (default: uncapped).",
    )
    g.add_argument(
        "--request-rate",
        type=rate_list,
        default=[None],
        help="Arrival rate in req/s, or inf for all at once; a comma list sweeps (default inf).",
    )
    g.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="Gamma shape of arrival gaps: 1 is Poisson, below 1 burstier (default 1).",
    )
    g.add_argument(
        "--num-warmups",
        type=non_negative_int,
        default=1,
        help="Warm-up requests sent first and left out of the figures (default 1).",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Ask the server to generate exactly the requested output lengths.",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="Sampling temperature (default 0, greedy)."
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body.")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds).",
    )
    o = p.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="Write the JSON results here.")
    o.add_argument(
        "--save-detailed", action="store_true", help="Keep per-request timings in the JSON results."
    )
    o.add_argument(
        "--plot",
        default=None,
        help="Write a PNG plot of throughput and TTFT against concurrency here.",
    )
    o.add_argument(
        "--overlay", nargs="*", default=[], help="Earlier results files drawn on the same plot."
    )
    o.add_argument(
        "--label", default=None, help="Name of this run in plots (default: server kind and model)."
    )
    o.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    p.set_defaults(func=run_serve)


def _warmup_sessions(sessions: list[Session], n: int) -> list[Session]:
    out = []
    for i in range(n):
        s = sessions[i % len(sessions)]
        t = s.turns[0]
        out.append(
            dataclasses.replace(
                s, turns=[Turn(t.prompt, t.prompt_len, min(t.output_len, 16))], arrival_s=None
            )
        )
    return out


def _extra_body(text: str | None) -> dict[str, Any]:
    """``--extra-body``'s object; a bad one is reported naming the flag (json's own message
    alone reads as if the server's answer were malformed)."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body: not a JSON object: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body: not a JSON object: {text!r}")
    return extra


async def _bench(args: argparse.Namespace) -> int:
    base = normalise_base_url(args.base_url)
    slos = parse_slos(args.goodput)
    extra = _extra_body(args.extra_body)
    overlays = [read_results(path) for path in args.overlay]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        models = await list_models(client, base, args.api_key)
        model = args.model or (models[0] if models else None)
        if model is None:
            raise ServerError(f"{base}/v1/models lists no model; pass --model.")
        tokenizer = None
        if args.dataset_name != "trace" or args.tokenizer:
            from fulcrum.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        as_text = args.prompt_format == "text" or (
            args.prompt_format == "auto" and args.endpoint == "chat"
        )
        sessions = build_sessions(args, tokenizer, as_text)
        ep = Endpoint(base, model, args.api_key, args.request_timeout)
        cfg = LoadConfig(ep, args.endpoint, args.ignore_eos, args.temperature, extra, args.seed)
        # One test request: a server that cannot answer it is an error, not a benchmark.
        test, _ = await run_sessions(
            client,
            cfg,
            _warmup_sessions(sessions, 1),
            max_concurrency=1,
            request_rate=None,
            tokenizer=tokenizer,
            show_progress=False,
        )
        if not test[0].success:
            raise ServerError(
                f"test request to {ep.url(sessions[0].endpoint or args.endpoint)} failed: {test[0].error}"
            )
        if args.num_warmups:
            await run_sessions(
                client,
                cfg,
                _warmup_sessions(sessions, args.num_warmups),
                max_concurrency=max((c or 0) for c in args.max_concurrency) or None,
                request_rate=None,
                tokenizer=tokenizer,
                desc="warm-up",
                show_progress=not args.disable_tqdm,
            )
        scraper = MetricsScraper(client, base + "/metrics")
        points: list[PointMetrics] = []
        for i, (mc, rate) in enumerate(itertools.product(args.max_concurrency, args.request_rate)):
            desc = f"conc={mc or 'inf'} rate={rate or 'inf'}"
            # Each point gets a fresh workload of the same shape (seed + 1 + i): a server's
            # prefix cache must not turn a sweep over "unique" prompts into repeats, and the
            # warm-up requests (seed) never overlap a measured point.
            point_args = argparse.Namespace(**{**vars(args), "seed": args.seed + 1 + i})
            point_sessions = build_sessions(point_args, tokenizer, as_text)
            await scraper.start()
            results, duration = await run_sessions(
                client,
                cfg,
                point_sessions,
                max_concurrency=mc,
                request_rate=rate,
                burstiness=args.burstiness,
                tokenizer=tokenizer,
                desc=desc,
                show_progress=not args.disable_tqdm,
            )
            figures = await scraper.stop()
            pm = compute_metrics(
                results,
                duration,
                max_concurrency=mc,
                request_rate=rate,
                burstiness=args.burstiness,
                slo_ms=slos,
                detailed=args.save_detailed,
            )
            pm.server = figures.to_dict() if figures is not None else None
            points.append(pm)
            print(point_block(pm))
        kind = (points[-1].server or {}).get("source", "unknown") if points else "unknown"
    print("=" * 40)
    print(summary_table(points))
    header = {
        "label": args.label or f"{kind}:{model}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": base,
        "endpoint": args.endpoint,
        "model": model,
        "server_kind": kind,
        "tokenizer": args.tokenizer or "default",
        "dataset": dataset_params(args),
        "num_sessions": len(sessions),
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "slo_ms": slos,
    }
    if args.result_file:
        write_results(args.result_file, header, points)
        print(f"results: {args.result_file}")
    if args.plot:
        from fulcrum.bench.plot import plot_results

        doc = {**header, "points": [p.to_dict() for p in points]}
        plot_results([*overlays, doc], args.plot)
        print(f"plot: {args.plot}")
    if any(p.completed == 0 for p in points):
        print(
            "fulcrum bench serve: every request of a run failed (see the errors above).",
            file=sys.stderr,
        )
        return 1
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_bench(args))
    except (ServerError, ValueError, OSError) as e:
        print(f"fulcrum bench serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
