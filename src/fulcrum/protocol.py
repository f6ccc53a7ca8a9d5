"""Messages across the engine-core boundary (msgspec structs: msgpack on the wire, never pickle).

The frontend (offline ``LLM`` or the API server's ``AsyncEngine``) tokenizes and sends an
``EngineCoreRequest``; the core answers each step with one ``EngineCoreOutputs`` holding an
``EngineCoreOutput`` for every request that produced tokens or finished. Text, stop strings and
the ``RequestOutput`` objects users see are made on the frontend side (``output_processor``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgspec

from fulcrum.sampling_params import SamplingParams

# The ``SamplingParams`` fields the core reads; text-level ones (stop strings, detokenization)
# stay on the frontend. Types and defaults come from ``SamplingParams`` itself, except where
# the wire holds a resolved value: ``max_tokens`` is resolved against the context limit and
# the token-id sets travel as lists.
CORE_FIELDS = (
    "n temperature top_p top_k min_p presence_penalty frequency_penalty repetition_penalty seed "
    "max_tokens min_tokens stop_token_ids ignore_eos logprobs prompt_logprobs all_stop_token_ids "
    "structured_outputs logit_bias allowed_token_ids bad_words_token_ids"
).split()
_WIRE_TYPES: dict[str, tuple[Any, Any]] = {
    "max_tokens": (int, 16),
    "stop_token_ids": (list[int], msgspec.field(default_factory=list)),
    # Set by the core: the model's EOS ids (min_tokens masks them, ignore_eos skips them).
    "all_stop_token_ids": (list[int], msgspec.field(default_factory=list)),
    # ``bad_words`` as token ids, read by the frontend's tokenizer
    "bad_words_token_ids": (list[list[int]], msgspec.field(default_factory=list)),
}


class _WireBase(msgspec.Struct, omit_defaults=True):
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0  # type: ignore[attr-defined]


def _wire_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(SamplingParams)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return [
        (name, *_WIRE_TYPES.get(name, (hints[name], defaults[name]))) for name in CORE_FIELDS
    ]


WireSamplingParams = msgspec.defstruct(
    "WireSamplingParams",
    _wire_fields(),
    bases=(_WireBase,),
    module=__name__,
    omit_defaults=True,
)
WireSamplingParams.__doc__ = "SamplingParams as sent to the core: its ``CORE_FIELDS``."


def to_wire(params: SamplingParams, max_tokens: int) -> WireSamplingParams:
    """The core's view of a ``SamplingParams``; ``max_tokens`` is resolved by the caller against
    the context limit."""
    fields = {f: getattr(params, f) for f in CORE_FIELDS}
    fields["max_tokens"] = max(1, max_tokens)
    fields["stop_token_ids"] = list(params.stop_token_ids or [])
    fields["all_stop_token_ids"] = sorted(params.all_stop_token_ids)
    fields["bad_words_token_ids"] = [list(w) for w in params.bad_words_token_ids]
    so = params.structured_outputs
    if so is not None and so.kind == "json" and not isinstance(so.json, str):
        # A schema travels as its JSON text: msgpack holds no integer past 64 bits, and a
        # schema may (an enum of big numbers, a bound); the grammar reads either form.
        fields["structured_outputs"] = dataclasses.replace(so, json=so.spec)
    return WireSamplingParams(**fields)


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: WireSamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None
    priority: int = 0
    client_index: int = 0  # which API process sent it (its outputs go back there)
    lora: str | None = None  # a LoRA adapter's name (``lora_modules``); None: the base model


class Logprobs(msgspec.Struct, array_like=True):
    """Per generated token: the sampled token's logprob and rank, plus the top alternatives."""

    token_logprob: float
    token_rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id, when one ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    first_scheduled_time: float | None = None  # wall time of first admission (first output only)
    # prompt token 1, 2, ...'s logprobs (``prompt_logprobs``; first output only)
    prompt_logprobs: list[Logprobs] | None = None
    # an embedding model's pooled prompt, float32 bytes (``runner="pooling"``; with its one,
    # dropped, token)
    pooled: bytes | None = None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use by running requests
    num_blocks_total: int = 0
    num_blocks_free: int = 0  # free or evictable
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # prompt tokens found (cumulative)
    prefix_cache_host_hits: int = 0  # of those, found in the host tier and copied back
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # speculative decoding (cumulative): verify steps with guesses, guesses, guesses accepted,
    # and guesses accepted at each position 1..k
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
