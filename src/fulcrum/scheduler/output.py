"""What one scheduling step decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.request import Request


@dataclass
class SchedulerOutput:
    """One step's batch. The scheduler has already advanced each request's
    ``num_computed_tokens`` past this step; ``starts`` keeps where each one began::

        request:  [ computed before (starts[i]) | num_new tokens this step ]
        samples[i]: the step reaches the request's last token, so one token is sampled; it is
                    *pending* (``Request.num_pending``) until ``Scheduler.update`` appends it
    """

    # (request, number of new tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    def add(self, req: Request, num_new_tokens: int, start: int, samples: bool) -> None:
        self.scheduled.append((req, num_new_tokens))
        self.starts.append(start)
        self.samples.append(samples)
        self.num_batched_tokens += num_new_tokens

    @property
    def num_sampled(self) -> int:
        return sum(self.samples)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
