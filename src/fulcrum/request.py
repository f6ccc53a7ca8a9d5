"""A sequence as the scheduler tracks it: one ``Request`` per generated sequence (n > 1 makes n of
them). It stays the scheduler's: the runner learns what it needs from ``SchedulerOutput``."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any

from fulcrum.protocol import WireSamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    """Token bookkeeping of one sequence.

    ``all_token_ids = prompt + output``. ``num_computed_tokens`` have KV in the cache or are
    being computed by a step already launched (the scheduler advances it when it schedules). A
    step that reaches the last token samples one; until ``Scheduler.update`` appends it, that
    token is *pending* (known only on the device)::

        all_token_ids (num_tokens)          pending (one per step in flight that samples it)
        [ p p p p p o o o o ]               [ x x ]      num_computed <= num_tokens + pending
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: WireSamplingParams,
        eos_token_ids: set[int],
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        parent: Request | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.key = f"{request_id}#{index}"
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # sampled by launched steps, not yet appended (<= steps in flight)
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1: not yet admitted)
        self.first_scheduled_time: float | None = None  # wall time of the first admission
        self.status = RequestStatus.WAITING
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_slot = 0  # its LoRA adapter (0: the base model)
        self.parent = parent  # n > 1: the sibling whose prefill this one shares
        self.num_preemptions = 0
        self.stop_reason: int | None = None
        self.num_runner_blocks = 0  # leading blocks of its table the runner has been sent
        self.spec_token_ids: list[int] = []  # guesses verified by the step in flight
        # prompt tokens 1, 2, ...'s logprobs as the steps computing them are collected (sent
        # with the first output, then dropped)
        self.prompt_logprobs: list[Any] | None = [] if params.prompt_logprobs is not None else None
        self.pooled: bytes | None = None  # an embedding model's vector (float32), until sent
        # Sampling needs no host-side history (penalties, min_tokens, a bad word of several
        # tokens), so the next step can be scheduled before this one's token is known.
        self.overlap_safe = (
            params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
            and params.min_tokens == 0
            and not any(len(w) > 1 for w in params.bad_words_token_ids)
        )
        # Structured output: the grammar compiling off the loop, then this sequence's matcher
        # (advanced on every appended token; the step's bitmask is filled from it). Typed Any:
        # this module sits below structured/ (structured.backend defines both types).
        self.grammar: Future[Any] | None = None
        self.matcher: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.key}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
