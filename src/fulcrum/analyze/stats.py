"""Length distributions, arrival rate and burstiness of a trace."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from fulcrum.analyze.trace import TraceRecord


@dataclass
class Distribution:
    """Summary of a sample; all zeros for an empty one."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(np.percentile(a, q)) for q in (50, 90, 99))
        return cls(len(a), float(a.mean()), p50, p90, p99, float(a.min()), float(a.max()))


@dataclass
class ArrivalStats:
    """``burstiness`` is the gamma shape 1/CV² of inter-arrival gaps: 1 is Poisson, below 1 is
    burstier (the meaning of ``fulcrum bench serve --burstiness``)."""

    duration_s: float
    request_rate: float
    interarrival_cv: float
    burstiness: float | None
    peak_rate_1s: int


@dataclass
class TraceStats:
    num_requests: int
    prompt_len: Distribution
    output_len: Distribution
    arrival: ArrivalStats | None
    ttft_s: Distribution
    server_cached_fraction: float | None  # from the log's num_cached_tokens, when present

    def to_dict(self) -> dict:
        return asdict(self)


def arrival_stats(times: list[float]) -> ArrivalStats | None:
    """None when fewer than two requests carry arrival times."""
    if len(times) < 2:
        return None
    t = np.sort(np.asarray(times, dtype=np.float64))
    duration = float(t[-1] - t[0])
    gaps = np.diff(t)
    mean_gap = float(gaps.mean())
    cv = float(gaps.std() / mean_gap) if mean_gap > 0 else math.inf
    burst = 1.0 / (cv * cv) if 0 < cv < math.inf else None
    rate = (len(t) - 1) / duration if duration > 0 else math.inf
    # Peak number of arrivals inside any window of one second.
    right = np.searchsorted(t, t + 1.0, side="left")
    peak = int((right - np.arange(len(t))).max())
    return ArrivalStats(duration, rate, cv, burst, peak)


def trace_stats(records: list[TraceRecord]) -> TraceStats:
    prompt = [float(r.num_prompt_tokens) for r in records]
    output = [float(r.num_output_tokens) for r in records if r.num_output_tokens is not None]
    times = [r.arrival_time for r in records if r.arrival_time is not None]
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    cached = [
        (r.num_cached_tokens, r.num_prompt_tokens)
        for r in records
        if r.num_cached_tokens is not None
    ]
    total = sum(p for _, p in cached)
    return TraceStats(
        num_requests=len(records),
        prompt_len=Distribution.of(prompt),
        output_len=Distribution.of(output),
        arrival=arrival_stats([float(x) for x in times]),
        ttft_s=Distribution.of([float(x) for x in ttft]),
        server_cached_fraction=(sum(c for c, _ in cached) / total) if total else None,
    )


def fit_prefill_rate(records: list[TraceRecord]) -> float | None:
    """Seconds of TTFT per computed prompt token, fitted on the log (None without data).

    Least squares of ``ttft = a + b * (prompt - cached)``; needs at least 8 requests with a
    TTFT, some spread in computed lengths, a positive slope and a correlation of at least 0.5
    (TTFTs dominated by queueing say nothing about prefill speed).
    """
    pts = [
        (r.num_prompt_tokens - (r.num_cached_tokens or 0), r.ttft_s)
        for r in records
        if r.ttft_s is not None
    ]
    if len(pts) < 8:
        return None
    x = np.asarray([p[0] for p in pts], dtype=np.float64)
    y = np.asarray([p[1] for p in pts], dtype=np.float64)
    if x.std() < 1.0:
        return None
    if y.std() == 0 or float(np.corrcoef(x, y)[0, 1]) < 0.5:
        return None
    b = float(np.polyfit(x, y, 1)[0])
    return b if b > 0 else None
