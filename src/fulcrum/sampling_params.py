"""Sampling parameters, validated on construction (vLLM's names and semantics)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


@dataclass(frozen=True)
class ThinkingGate:
    """A reasoning model's thinking stays free; the grammar constrains the answer after it.

    ``start_id`` / ``end_id``: the tokens that open and close the thinking (``<think>``,
    ``</think>``). ``opens``: ``"thinking"`` where the output begins inside the thinking (the
    prompt left it open), ``"either"`` where the first token may be ``start_id`` (then the
    model thinks) or the answer's first token (the grammar's, from there on)."""

    start_id: int
    end_id: int
    opens: str = "thinking"

    def __post_init__(self) -> None:
        if self.opens not in ("thinking", "either"):
            raise ValueError(
                f"structured_outputs.thinking.opens must be 'thinking' or 'either', got {self.opens!r}."
            )


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's names): exactly one field is set.

    ``json``: a JSON schema (dict or its text); ``regex``; ``choice``: the output is one of these
    strings; ``grammar``: EBNF (GBNF); ``structural_tag``: xgrammar's structural-tag JSON;
    ``json_object``: any JSON object. ``thinking``: a reasoning model's thinking is left free
    (the constraint starts after it; see ``ThinkingGate``)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    json_object: bool | None = None
    thinking: ThinkingGate | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            why = "none" if not given else ", ".join(given)
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; got {why}."
            )
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) or c == "" for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (schemas as canonical JSON text): the cache key's body."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return json.dumps(value, sort_keys=True)
        if self.kind == "choice":
            return json.dumps(value)
        if self.kind == "json_object":
            return ""
        return str(value)


@dataclass
class SamplingParams:
    """How to turn logits into tokens for one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k. ``logprobs=k`` returns
    the sampled token's log-probability plus the ``k`` most likely alternatives (0 ≤ k ≤ 20);
    ``prompt_logprobs=k`` the same for every prompt token after the first (scoring a text, as
    evaluation harnesses do: such a request computes its whole prompt, no prefix-cache hits).
    Stop strings are excluded from the returned text unless ``include_stop_str_in_output``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> bias in [-100, 100] added to that token's logit before sampling (OpenAI's
    # ``logit_bias``): -100 all but bans a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # The only token ids that may be drawn (vLLM's ``allowed_token_ids``): classification,
    # multiple choice. EOS ends the sequence only if listed.
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (-1: as many as fit beside max_tokens), vLLM's field: a
    # prompt that outgrows the context (a long RAG context, a long chat) loses its oldest tokens
    # instead of failing. Applied where the prompt is tokenized, not in the engine core.
    truncate_prompt_tokens: int | None = None
    # Words that must not be generated (vLLM's ``bad_words``): a word's last token is banned
    # where the tokens before it were just generated; each word is read with and without a
    # leading space, as it appears mid-text.
    bad_words: list[str] | None = None
    # Filled by the engine: EOS ids of the model (not part of the user surface).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled where the prompt is tokenized (``tokenize_bad_words``): ``bad_words`` as token ids.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:  # an empty map biases nothing: the plain path
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are irrelevant; normalise them so batches stay simple.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        if self.top_k == 0:
            self.top_k = -1

    def _verify(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(
                "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}."
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers.")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", f"must be -1 or at least 1, got {k!r}.")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not allowed or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids.")
        if self.bad_words is not None and (
            isinstance(self.bad_words, str)
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "must be a list of non-empty strings.")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("logit_bias", f"keys must be non-negative token ids, got {t!r}.")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {b!r} for {t}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


def truncate_prompt(
    ids: list[int], keep: int | None, max_model_len: int, max_tokens: int | None
) -> list[int]:
    """``truncate_prompt_tokens``: the last ``keep`` ids (-1: as many as fit in the context
    beside ``max_tokens``, or beside one token), or all of them (None)."""
    n = max_model_len - (max_tokens or 1) if keep == -1 else keep
    return ids if n is None or len(ids) <= n else ids[-n:]


def tokenize_bad_words(params: SamplingParams, tokenizer: Any) -> None:
    """Fill ``params.bad_words_token_ids`` from ``params.bad_words``: each word as it starts a
    text and, where that differs, after a space (vLLM's reading). ValueError naming the field
    without a tokenizer."""
    if not params.bad_words:
        return
    if tokenizer is None:
        raise ValueError("bad_words: this model has no tokenizer to read them with; pass "
                         "logit_bias or allowed_token_ids instead.")  # fmt: skip
    seqs: list[list[int]] = []
    for word in params.bad_words:
        for prefix in ("", " "):
            ids = list(tokenizer(prefix + word.lstrip(), add_special_tokens=False).input_ids)
            if ids and ids not in seqs:
                seqs.append(ids)
    params.bad_words_token_ids = seqs
