"""What one scheduling step decided."""

from __future__ import annotations

from dataclasses import dataclass, field

from fulcrum.engine.request import Request


@dataclass
class SchedulerOutput:
    # (request, number of new tokens to compute this step), in batch order
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    def add(self, req: Request, num_new_tokens: int) -> None:
        self.scheduled.append((req, num_new_tokens))
        self.num_batched_tokens += num_new_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
