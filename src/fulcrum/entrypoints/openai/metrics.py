"""Prometheus metrics, named as vLLM names them (``fulcrum:`` instead of ``vllm:``).

Scheduler-side numbers (running/waiting requests, KV-cache blocks, prefix-cache counters,
preemptions) come from the latest ``SchedulerStats`` the core pushed; they are exported by a
collector at scrape time. Token counters and latency histograms are observed on the frontend as
outputs arrive (see ``AsyncEngine``'s stats sink).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.protocol import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]


class _SchedulerCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._m.stats
        name = self._m.model_name
        labels = ["model_name"]

        def gauge(metric: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"fulcrum:{metric}", doc, labels=labels)
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"fulcrum:{metric}", doc, labels=labels)
            c.add_metric([name], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage (1 = 100%).", s.kv_cache_usage)
        yield gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.", s.num_blocks_total)
        yield gauge("kv_cache_blocks_free", "KV-cache blocks free or evictable.", s.num_blocks_free)
        if not self._m.multiprocess:
            yield gauge(
                "num_requests_in_flight",
                "Requests accepted by the server, not finished.",
                self._m.num_in_flight,
            )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield counter(
            "prefix_cache_host_hits",
            "Of those, tokens found in the host tier (--host-kv-cache-memory) and copied back.",
            s.prefix_cache_host_hits,
        )
        yield counter("num_preemptions", "Cumulative preemptions.", s.num_preemptions_total)
        # speculative decoding, as vLLM names it (0 while speculation is off)
        yield counter(
            "spec_decode_num_drafts",
            "Verify steps of a request with guesses.",
            s.spec_decode_num_drafts,
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Tokens guessed.", s.spec_decode_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Guessed tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "fulcrum:spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens accepted at each position (0: the first guess).",
            labels=[*labels, "position"],
        )
        for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([name, str(pos)], n)
        yield per_pos


class ServerMetrics:
    """The server's registry; implements the ``AsyncEngine`` stats-sink callbacks."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.num_in_flight = 0
        self.in_flight_source: Callable[[], int] | None = None  # the engine's count, when known
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        # Several API processes (``--api-server-count``): prometheus_client writes each process's
        # counters and histograms to files in this folder and a scrape sums them; the requests
        # in flight are each process's own, so they become a summed gauge too.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._in_flight_gauge = (
            Gauge(
                "fulcrum:num_requests_in_flight",
                "Requests accepted by the server, not finished.",
                labels,
                registry=None,
                multiprocess_mode="livesum",
            ).labels(model_name)
            if self.multiprocess
            else None
        )
        self.registry.register(_SchedulerCollector(self))
        self._prompt_tokens = Counter(
            "fulcrum:prompt_tokens", "Prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self._generation_tokens = Counter(
            "fulcrum:generation_tokens", "Generation tokens produced.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "fulcrum:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._ttft = Histogram(
            "fulcrum:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._itl = Histogram(
            "fulcrum:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._e2e = Histogram(
            "fulcrum:e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._queue = Histogram(
            "fulcrum:request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._req_prompt = Histogram(
            "fulcrum:request_prompt_tokens",
            "Prompt length per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._req_gen = Histogram(
            "fulcrum:request_generation_tokens",
            "Output length per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)

    # --- stats sink (called by AsyncEngine on the event loop) ---
    def on_stats(self, stats: SchedulerStats) -> None:
        self.stats = stats
        if self._in_flight_gauge is not None and self.in_flight_source is not None:
            self._in_flight_gauge.set(self.in_flight_source())

    def on_prompt(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new_tokens: int) -> None:
        self._generation_tokens.inc(num_new_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_inter_token(self, itl_s: float) -> None:
        self._itl.observe(itl_s)

    def on_finished(
        self,
        finish_reason: str,
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self._e2e.observe(e2e_s)
        if queue_s is not None:
            self._queue.observe(max(queue_s, 0.0))
        self._req_prompt.observe(num_prompt_tokens)
        self._req_gen.observe(num_output_tokens)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_SchedulerCollector(self))
        return generate_latest(registry)
