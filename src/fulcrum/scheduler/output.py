"""What one scheduling step decided, in the form the runner consumes.

The runner keeps its own state per request (token ids, block-table row, sampling parameters) and
never sees the scheduler's ``Request`` objects. A step tells it only what changed::

    scheduled_new_reqs     first scheduled, or resumed after preemption: everything (a copy)
    scheduled_cached_reqs  already held by the runner: blocks appended since its last step
                           and where this step starts (tokens it samples it learns itself)
    finished_req_ids       finished or aborted since the last step: the runner drops them

Rows are in batch order: the cached requests, then the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fulcrum.protocol import WireSamplingParams


@dataclass
class NewRequestData:
    """A request the runner does not hold yet (or must take afresh after preemption)."""

    req_id: str  # the sequence's key, ``request_id#index``
    index: int  # its place among the request's n sequences (seeded draws depend on it)
    prompt_token_ids: list[int]  # shared, never modified
    output_token_ids: list[int]  # generated before a preemption ([] when first scheduled)
    sampling_params: WireSamplingParams
    block_ids: list[int]  # its whole block table
    num_computed_tokens: int  # tokens with KV before this step (a prefix-cache hit, or 0)
    lora_slot: int = 0  # its LoRA adapter's slot (0: the base model)


@dataclass
class CachedRequestData:
    """Requests the runner already holds, in batch order: what changed since their last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int] | None] = field(default_factory=list)  # None: no new block
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # Where ``new_block_ids`` start in the runner's row: below its length when the scheduler
    # freed the tail of the table (a verify step's rejected tokens).
    block_offsets: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's batch. The scheduler has already advanced each request past this step::

        request:  [ num_computed_tokens (before) | num_scheduled_tokens this step ]
        samples[i]: the step reaches the request's last token, so one token is sampled; it is
                    *pending* (``Request.num_pending``) until ``Scheduler.update`` appends it
        speculative: [ computed | last token, d_1 .. d_k ] one step; ``update`` appends the
                    1 to k + 1 tokens verified and moves ``num_computed_tokens`` back over
                    the rejected guesses
    """

    step_id: int = 0  # the scheduler finds this step's requests by it in ``update``
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # batch order
    samples: list[bool] = field(default_factory=list)  # batch order
    finished_req_ids: list[str] = field(default_factory=list)
    # Preempted by this step: their KV is gone; each comes back in ``scheduled_new_reqs``.
    preempted_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Structured output: allowed tokens of each sampled row (int32 words, xgrammar's layout),
    # filled on the host by ``Scheduler.grammar_bitmask`` after the forward is launched and the
    # previous step's tokens are in; None when no sampled row has a grammar.
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: a request's guesses, scheduled after its last token (its
    # ``num_scheduled_tokens`` is 1 + their number); logits are computed at each of them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Block copies between the device and the host tier (kv_cache/host_tier.py), in order:
    # the runner makes them before this step's forward.
    kv_copies: list[tuple[str, list[int], list[int]]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def req_ids(self) -> list[str]:
        """Batch order."""
        return self.scheduled_cached_reqs.req_ids + [r.req_id for r in self.scheduled_new_reqs]

    @property
    def num_computed_tokens(self) -> list[int]:
        """Where each row starts, in batch order."""
        new = [r.num_computed_tokens for r in self.scheduled_new_reqs]
        return self.scheduled_cached_reqs.num_computed_tokens + new

    @property
    def num_sampled(self) -> int:
        return sum(self.samples)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
