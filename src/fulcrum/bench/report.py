"""Terminal tables and the JSON results file of ``fulcrum bench serve``.

Results file (``schema: "fulcrum.bench.serve/1"``)::

    {"schema", "label", "date" (ISO 8601), "base_url", "endpoint" ("chat"|"completions"),
     "model", "server_kind" ("fulcrum"|"vllm"|"sglang"|"unknown"), "tokenizer",
     "dataset": {"name", ...its parameters}, "num_sessions", "num_warmups", "seed",
     "ignore_eos", "slo_ms": {"ttft"|"tpot"|"e2el": ms},
     "points": [PointMetrics.to_dict(), ...]}      # one per (max concurrency, request rate)

A point (see ``fulcrum.bench.metrics``): ``max_concurrency`` (null: uncapped),
``request_rate`` (req/s; null: all at once), ``burstiness``, ``num_requests`` = ``completed`` +
``failed``, ``errors`` {message: count}, ``duration_s``, ``total_input_tokens``,
``total_output_tokens``, ``request_throughput``, ``output_throughput``,
``total_token_throughput`` (tokens / duration_s), ``good_requests`` / ``goodput`` (null without
SLOs), ``mean_concurrency``, ``peak_concurrency``, ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` /
``e2el_ms`` as {mean, std, min, p50, p95, p99, max}, ``server`` (null without /metrics:
{source, kv_cache_usage_max, kv_cache_usage_mean, prefix_cache_hit_rate,
prefix_cache_queries, preemptions, spec_decode_num_drafts, spec_decode_mean_acceptance_length,
peak_gpu_memory_bytes, num_samples}), and ``requests``
(per-request detail, only with ``--save-detailed``).
"""

from __future__ import annotations

import json
from typing import Any

from fulcrum.bench.metrics import PointMetrics

SCHEMA = "fulcrum.bench.serve/1"


def _rate(x: float | None) -> str:
    return "inf" if x is None else f"{x:g}"


def point_block(p: PointMetrics) -> str:
    """vLLM-style block for one point."""
    rows: list[tuple[str, str]] = [
        ("Max concurrency", str(p.max_concurrency or "none")),
        ("Request rate (req/s)", _rate(p.request_rate)),
        ("Successful requests", str(p.completed)),
        ("Failed requests", str(p.failed)),
        ("Benchmark duration (s)", f"{p.duration_s:.2f}"),
        ("Total input tokens", str(p.total_input_tokens)),
        ("Total generated tokens", str(p.total_output_tokens)),
        ("Request throughput (req/s)", f"{p.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{p.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{p.total_token_throughput:.2f}"),
        ("Mean / peak concurrency", f"{p.mean_concurrency:.2f} / {p.peak_concurrency}"),
    ]
    if p.goodput is not None:
        rows.append(("Request goodput (req/s)", f"{p.goodput:.2f} ({p.good_requests} good)"))
    for name, pc in (
        ("TTFT", p.ttft_ms),
        ("TPOT", p.tpot_ms),
        ("ITL", p.itl_ms),
        ("E2EL", p.e2el_ms),
    ):
        rows.append(
            (
                f"{name} ms mean/p50/p95/p99",
                f"{pc.mean:.1f} / {pc.p50:.1f} / {pc.p95:.1f} / {pc.p99:.1f}",
            )
        )
    s = p.server or {}
    if s:
        if s.get("kv_cache_usage_max") is not None:
            rows.append(("Server KV cache usage max", f"{s['kv_cache_usage_max']:.1%}"))
        if s.get("prefix_cache_hit_rate") is not None:
            rows.append(("Server prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}"))
        if s.get("preemptions") is not None:
            rows.append(("Server preemptions", f"{s['preemptions']:.0f}"))
        if s.get("spec_decode_mean_acceptance_length") is not None:
            rows.append(
                ("Mean acceptance length", f"{s['spec_decode_mean_acceptance_length']:.2f}")
            )
        if s.get("peak_gpu_memory_bytes") is not None:
            rows.append(
                ("Server peak GPU memory (GiB)", f"{s['peak_gpu_memory_bytes'] / 2**30:.2f}")
            )
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * (width + 28)]
    lines += [f"{k + ':':<{width}}{v:>28}" for k, v in rows]
    for err, count in p.errors.items():
        lines.append(f"  error x{count}: {err}")
    return "\n".join(lines)


def summary_table(points: list[PointMetrics]) -> str:
    """One line per point: the sweep at a glance."""
    head = (
        f"{'conc':>6} {'rate':>6} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'ITL p95':>8} {'E2E p99':>9}"
    )
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(
            f"{p.max_concurrency or '-':>6} {_rate(p.request_rate):>6} {p.completed:>5} "
            f"{p.failed:>4} {p.request_throughput:>7.2f} {p.output_throughput:>10.1f} "
            f"{p.ttft_ms.p50:>9.1f} {p.ttft_ms.p95:>9.1f} {p.tpot_ms.p50:>9.1f} "
            f"{p.itl_ms.p95:>8.1f} {p.e2el_ms.p99:>9.1f}"
        )
    return "\n".join(lines) + "\n(latencies in ms)"


def write_results(path: str, header: dict[str, Any], points: list[PointMetrics]) -> None:
    doc = {"schema": SCHEMA, **header, "points": [p.to_dict() for p in points]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def read_results(path: str) -> dict[str, Any]:
    """Load a results file; ``ValueError`` (one line) when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}).") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or "points" not in doc:
        raise ValueError(f"{path}: not a fulcrum bench serve results file.")
    return doc
