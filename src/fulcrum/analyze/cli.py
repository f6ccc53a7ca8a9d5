"""``fulcrum analyze TRACE``: prefix overlap, traffic shape and a serving recommendation."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fulcrum.analyze.overlap import OverlapReport, simulate_overlap
from fulcrum.analyze.pools import pools_to_dict, recommend_pools, render_pools
from fulcrum.analyze.recommend import Recommendation, recommend
from fulcrum.analyze.stats import Distribution, TraceStats, fit_prefill_rate, trace_stats
from fulcrum.analyze.trace import TraceError, load_trace, needs_tokenizer

DEFAULT_CAPACITY = 262144


def _capacity(text: str) -> int | None:
    if text.lower() in ("inf", "unbounded", "none"):
        return None
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or 'inf', got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("capacity must be non-negative")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="Measure a request log's prefix overlap and recommend serve flags.",
        description=(
            "Replay a request log (the server's --log-requests-file JSONL, or OpenAI request "
            "bodies one per line) through a radix prefix-cache simulation and recommend a "
            "fulcrum serve configuration."
        ),
    )
    p.add_argument("trace", metavar="TRACE", help="JSONL request log to analyze.")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer (HF directory or .gguf file) for requests without token ids; "
        "default: the embedded default model's.",
    )
    p.add_argument(
        "--capacity-tokens",
        type=_capacity,
        default=DEFAULT_CAPACITY,
        help=f"Simulated prefix-cache size in tokens, or 'inf' (default {DEFAULT_CAPACITY}).",
    )
    p.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        help="Cache block size in tokens; 1 simulates a token-granular cache (default 16).",
    )
    p.add_argument(
        "--prefill-tps",
        type=float,
        default=None,
        help="Prefill tokens/s used to estimate the TTFT saved; default: fitted on the log's "
        "TTFTs when it has them, else an assumed rate.",
    )
    p.add_argument("--top", type=_positive_int, default=5, help="Groups to list (default 5).")
    p.add_argument("--json", action="store_true", help="Print the full report as JSON.")
    p.set_defaults(func=run)


def analyze(args: argparse.Namespace) -> dict[str, Any]:
    """Run the analysis; return the JSON-able report (raises ``ValueError`` for users)."""
    if args.prefill_tps is not None and args.prefill_tps <= 0:
        raise ValueError("--prefill-tps must be positive.")
    records = load_trace(args.trace)
    tokenizer = None
    if needs_tokenizer(records):
        from fulcrum.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    records = load_trace(args.trace, tokenizer) if tokenizer is not None else records
    stats = trace_stats(records)
    bounded = simulate_overlap(records, args.capacity_tokens, args.block_size)
    unbounded = (
        bounded
        if args.capacity_tokens is None
        else simulate_overlap(records, None, args.block_size)
    )
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    models = {r.model for r in records if r.model}
    pools = recommend_pools(records)
    rec = recommend(
        stats,
        bounded,
        unbounded,
        model=models.pop() if len(models) == 1 else None,
        mean_e2e_s=sum(e2e) / len(e2e) if e2e else None,
        prefill_s_per_token=fit_prefill_rate(records),
        prefill_tps=args.prefill_tps,
        serve_flags=getattr(args, "serve_flags", None),
    )
    return {
        "trace": args.trace,
        "stats": stats.to_dict(),
        "overlap": bounded.to_dict(args.top),
        "overlap_unbounded": unbounded.to_dict(args.top),
        "recommendation": rec.to_dict(),
        "pools": pools_to_dict(pools),
        "_objects": (stats, bounded, unbounded, rec, pools),
    }


def _dist(name: str, d: Distribution, unit: str = "") -> str:
    if not d.count:
        return f"  {name:<16} n/a"
    return (
        f"  {name:<16} mean {d.mean:9.1f}{unit}  p50 {d.p50:9.1f}  p90 {d.p90:9.1f}  "
        f"p99 {d.p99:9.1f}  max {d.max:9.1f}"
    )


def render(report: dict[str, Any]) -> str:
    stats: TraceStats
    bounded: OverlapReport
    unbounded: OverlapReport
    rec: Recommendation
    stats, bounded, unbounded, rec, pools = report["_objects"]
    cap = "unbounded" if bounded.capacity_tokens is None else f"{bounded.capacity_tokens:,}"
    lines = [f"Trace {report['trace']}: {stats.num_requests} requests", "", "Lengths (tokens)"]
    lines.append(_dist("prompt", stats.prompt_len))
    lines.append(_dist("output", stats.output_len))
    a = stats.arrival
    if a is not None:
        rate = f"{a.request_rate:.3f}" if math.isfinite(a.request_rate) else "inf"
        burst = "n/a" if a.burstiness is None else f"{a.burstiness:.2f}"
        lines += [
            "",
            f"Arrivals: {rate} req/s over {a.duration_s:.1f} s, inter-arrival CV "
            f"{a.interarrival_cv:.2f}, burstiness {burst} (1 = Poisson), peak {a.peak_rate_1s}/s",
        ]
    lines += [
        "",
        f"Prefix overlap (block {bounded.block_size}, capacity {cap} tokens): "
        f"{bounded.overlap:.1%} of {bounded.prompt_tokens:,} prompt tokens from cache "
        f"(unbounded cache: {unbounded.overlap:.1%}; evicted blocks: {bounded.evicted_blocks:,})",
    ]
    if stats.server_cached_fraction is not None:
        lines.append(f"  server reported cached: {stats.server_cached_fraction:.1%}")
    d = report["overlap"]
    lines.append(f"  by system prompt ({d['num_system_prompts']}):")
    for g in d["by_system_prompt"]:
        lines.append(f"    {g['overlap']:6.1%}  {g['num_requests']:6d} req  {g['key']}")
    lines.append(
        f"  by conversation ({d['num_conversations']}, {d['num_multi_turn_conversations']} "
        f"multi-turn; multi-turn overlap {d['multi_turn_overlap']:.1%}):"
    )
    for g in d["by_conversation"]:
        lines.append(f"    {g['overlap']:6.1%}  {g['num_requests']:6d} req  {g['key']}")
    lines += ["", "Recommendation:"]
    lines += [f"  - {r}" for r in rec.reasons]
    lines += ["", f"  {rec.command}"]
    lines += render_pools(pools)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        report = analyze(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"fulcrum analyze: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        report.pop("_objects")
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0
