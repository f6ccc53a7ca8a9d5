"""``fulcrum bench serve|offline|cold-start|plot``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _plot(args: argparse.Namespace) -> int:
    from fulcrum.bench.plot import plot_results
    from fulcrum.bench.report import read_results

    try:
        docs = [read_results(path) for path in args.results]
        plot_results(docs, args.output, args.title)
    except (ValueError, OSError) as e:
        print(f"fulcrum bench plot: error: {e}", file=sys.stderr)
        return 2
    print(f"plot: {args.output}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``bench`` and its sub-subcommands."""
    from fulcrum.bench.cold_start import add_cold_start_parser
    from fulcrum.bench.offline import add_offline_parser
    from fulcrum.bench.serve import add_serve_parser

    p = subparsers.add_parser(
        "bench",
        help="Benchmark a server (serve), the engine in-process (offline) or start-up time.",
        description="Benchmarks with vLLM's metric definitions.",
    )
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    add_serve_parser(sub)
    add_offline_parser(sub)
    add_cold_start_parser(sub)
    pp = sub.add_parser(
        "plot",
        help="Overlay bench serve results files in one PNG.",
        description="Plot throughput and TTFT p50/p95 against concurrency, one line per file.",
    )
    pp.add_argument("results", nargs="+", help="bench serve --result-file JSON files.")
    pp.add_argument("-o", "--output", required=True, help="PNG file to write.")
    pp.add_argument("--title", default=None, help="Title above the plots.")
    pp.set_defaults(func=_plot)

    def _usage(_: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_usage)
