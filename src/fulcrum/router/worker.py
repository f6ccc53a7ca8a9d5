"""One upstream worker as the router sees it: its URL and key, requests in flight, the load it
reports on ``/metrics``, and its circuit breaker."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.router.breaker import CircuitBreaker
from fulcrum.router.prefix_tree import PrefixTree

# Gauges of running and waiting requests, by engine (summed over label sets).
RUNNING_METRICS = (
    "fulcrum:num_requests_running",
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
)
WAITING_METRICS = (
    "fulcrum:num_requests_waiting",
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
)


@dataclass(eq=False)
class Worker:
    url: str
    pool: str
    api_key: str | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    tree: PrefixTree = field(default_factory=PrefixTree)
    in_flight: int = 0  # requests this router has sent and not finished
    reported_running: int | None = None  # from the last /metrics scrape, when it has the gauges
    reported_waiting: int | None = None
    healthy: bool = True  # the last health check answered 200

    @property
    def load(self) -> int:
        """Outstanding requests: the router's own count, or the worker's when it reports more
        (other clients, or requests the router already gave up on)."""
        reported = (self.reported_running or 0) + (self.reported_waiting or 0)
        return max(self.in_flight, reported)

    def available(self) -> bool:
        """Health checks feed the breaker too, so it alone decides."""
        return self.breaker.available()

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "pool": self.pool,
            "in_flight": self.in_flight,
            "running": self.reported_running,
            "waiting": self.reported_waiting,
            "healthy": self.healthy,
            "breaker": self.breaker.state,
            "cache_tree_chars": self.tree.size_chars,
        }


def parse_load(text: str) -> tuple[int | None, int | None]:
    """Running and waiting requests from a Prometheus text exposition (None when absent)."""
    running: float | None = None
    waiting: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in RUNNING_METRICS or name in WAITING_METRICS:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if name in RUNNING_METRICS:
                running = (running or 0.0) + value
            else:
                waiting = (waiting or 0.0) + value
    return (
        None if running is None else int(running),
        None if waiting is None else int(waiting),
    )
