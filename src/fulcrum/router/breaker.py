"""Per-worker circuit breaker: consecutive failures take a worker out; after a cooldown one probe
(a health check or a request) may go through, and its outcome closes or re-opens the breaker."""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = max(1, failure_threshold)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0

    def available(self) -> bool:
        """May a request be sent? True when closed, or open and cooled down (the probe)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self._clock() - self.opened_at >= self.cooldown_s
        return False  # half open: the probe is out, wait for its outcome

    def on_dispatch(self) -> None:
        """A request or probe was sent; past the cooldown an open breaker lets only this one."""
        if self.state == OPEN and self.available():
            self.state = HALF_OPEN

    def record_success(self) -> None:
        self.state = CLOSED
        self.failures = 0

    def record_failure(self) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = OPEN
            self.opened_at = self._clock()
