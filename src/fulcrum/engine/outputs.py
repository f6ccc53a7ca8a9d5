"""What users get back: ``RequestOutput`` with one ``CompletionOutput`` per sequence (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    decoded: str = ""


# One entry per generated token: {token_id: TokenLogprob} holding the sampled token and the
# top-k alternatives (vLLM's SampleLogprobs shape).
SampleLogprobs = list[dict[int, TokenLogprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    # ``prompt_logprobs``: one entry per prompt token (None for the first, which nothing
    # predicts), in ``logprobs``' shape; on the first output that carries it.
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None
    # runner "pooling": the prompt's pooled hidden states, float32 bytes, unnormalized
    # (``entrypoints/embedding.py`` applies a request's dimensions and the normalization)
    pooled: bytes | None = None
