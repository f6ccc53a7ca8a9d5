"""The router's Prometheus metrics: requests, errors, retries and latency per worker and pool,
worker state, and the cache-aware policy's estimated hit rate."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], tuple[list, dict[str, float | None]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        workers, hit_rates = self._snapshot()

        def per_worker(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"fulcrum_router:{name}", doc, labels=["worker", "pool"])

        in_flight = per_worker("worker_in_flight", "Requests sent and not finished.")
        load = per_worker("worker_load", "Outstanding requests the policies see.")
        up = per_worker(
            "worker_available", "1 while the worker's circuit breaker lets requests through."
        )
        tree = per_worker(
            "cache_tree_chars", "Prompt characters in the worker's approximate prefix tree."
        )
        for w in workers:
            labels = [w.url, w.pool]
            in_flight.add_metric(labels, w.in_flight)
            load.add_metric(labels, w.load)
            up.add_metric(labels, 1.0 if w.available() else 0.0)
            tree.add_metric(labels, w.tree.size_chars)
        hit = GaugeMetricFamily(
            "fulcrum_router:cache_estimated_hit_rate",
            "cache_aware pools: share of routed prompt characters estimated in the chosen "
            "worker's prefix cache.",
            labels=["pool"],
        )
        for pool, rate in hit_rates.items():
            if rate is not None:
                hit.add_metric([pool], rate)
        yield from (in_flight, load, up, tree, hit)


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], tuple[list, dict[str, float | None]]]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["worker", "pool"]
        self.requests = Counter(
            "fulcrum_router:requests",
            "Requests answered, by status code.",
            [*labels, "code"],
            registry=r,
        )
        self.errors = Counter(
            "fulcrum_router:errors",
            "Failed attempts (connect error, timeout, 5xx, broken stream).",
            labels,
            registry=r,
        )
        self.retries = Counter(
            "fulcrum_router:retries", "Attempts retried on another worker.", ["pool"], registry=r
        )
        self.latency = Histogram(
            "fulcrum_router:request_latency_seconds",
            "Time from receiving a request to its last byte.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "fulcrum_router:time_to_first_byte_seconds",
            "Time from receiving a request to the first upstream body byte.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_StateCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
