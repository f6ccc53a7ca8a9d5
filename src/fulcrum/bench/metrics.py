"""Benchmark figures with vLLM's definitions (``vllm bench serve``).

Over the *successful* requests of one run of duration ``D`` (first send to last completion):

* request throughput = completed / D; output throughput = output tokens / D;
  total token throughput = (input + output tokens) / D.
* TTFT: send to first text chunk. TPOT: (latency - TTFT) / (output tokens - 1), for requests
  with more than one output token. ITL: every gap between text chunks, pooled. E2EL: latency.
* goodput = requests meeting every given SLO (ms; ``ttft``, ``tpot``, ``e2el``) / D.
* mean concurrency = sum of latencies / D; peak concurrency = most requests in flight at once.

Failed requests are counted (``failed``, ``errors``) and take no part in the latency figures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from fulcrum.bench.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class Percentiles:
    """Milliseconds; zeros for an empty sample."""

    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of_seconds(cls, values: list[float]) -> Percentiles:
        if not values:
            return cls()
        a = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p95, p99 = (float(np.percentile(a, q)) for q in (50, 95, 99))
        return cls(float(a.mean()), float(a.std()), float(a.min()), p50, p95, p99, float(a.max()))


@dataclass
class PointMetrics:
    """One run of the sweep: a (max concurrency, request rate) point."""

    max_concurrency: int | None
    request_rate: float | None  # None: every request sent at once
    burstiness: float
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    good_requests: int | None
    goodput: float | None
    mean_concurrency: float
    peak_concurrency: int
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2el_ms: Percentiles
    errors: dict[str, int] = field(default_factory=dict)
    server: dict | None = None
    requests: list[dict] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["requests"] is None:
            del d["requests"]
        return d


def tpot_of(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def peak_in_flight(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = cur = 0
    for _, delta in events:  # ends sort before starts at equal times
        cur += delta
        peak = max(peak, cur)
    return peak


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    *,
    max_concurrency: int | None,
    request_rate: float | None,
    burstiness: float,
    slo_ms: dict[str, float] | None = None,
    detailed: bool = False,
) -> PointMetrics:
    """Aggregate one run; ``slo_ms`` maps ``ttft``/``tpot``/``e2el`` to limits in ms."""
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    tpots = [t for r in ok if (t := tpot_of(r)) is not None]
    good: int | None = None
    if slo_ms:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.latency}
            good += all(vals[k] * 1000.0 <= v for k, v in slo_ms.items())
    reqs = None
    if detailed:
        reqs = [
            {
                "session_id": r.session_id,
                "turn": r.turn,
                "success": r.success,
                "error": r.error,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft_s": r.ttft,
                "latency_s": r.latency,
                "itl_s": r.itl,
            }
            for r in results
        ]
    return PointMetrics(
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        num_requests=len(results),
        completed=len(ok),
        failed=len(bad),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / dur,
        output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur,
        good_requests=good,
        goodput=None if good is None else good / dur,
        mean_concurrency=sum(r.latency for r in ok) / dur,
        peak_concurrency=peak_in_flight([(r.start_time, r.start_time + r.latency) for r in ok]),
        ttft_ms=Percentiles.of_seconds([r.ttft for r in ok]),
        tpot_ms=Percentiles.of_seconds(tpots),
        itl_ms=Percentiles.of_seconds([x for r in ok for x in r.itl]),
        e2el_ms=Percentiles.of_seconds([r.latency for r in ok]),
        errors=dict(Counter(r.error for r in bad)),
        requests=reqs,
    )


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            if not sep or name not in SLO_METRICS:
                raise ValueError(
                    f"--goodput: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, "
                    f"got {part!r}."
                )
            try:
                out[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {value!r} is not a number of ms.") from None
            if out[name] <= 0:
                raise ValueError(f"--goodput: the {name} SLO must be positive.")
    return out
