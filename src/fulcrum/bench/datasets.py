"""Seeded, reproducible benchmark workloads.

Every dataset yields ``Session``s: a session is one request (``turns`` of length one) or a
conversation whose later turns carry the earlier answers (multi-turn). Lengths are in tokens of
the given tokenizer. Prompts are random *vocabulary-safe* token ids (special tokens excluded) or
their decoded text, re-encoded until the text has the asked length.

* ``random``: input/output lengths uniform in ``[L*(1-r), L*(1+r)]`` (``r`` = range ratio).
* ``prefix-repetition``: ``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each request
  one of them (round robin) plus a unique ``suffix_len`` suffix. On the chat endpoint the prefix
  is the system prompt and the suffix the user message.
* ``multi-turn``: ``conversations`` x ``turns``; each user turn is ``input_len`` tokens and the
  request for turn k carries the system prompt, the k-1 earlier user turns and their answers.
* ``sharegpt-like``: a synthetic stand-in for the ShareGPT conversations that vLLM benchmarks
  use (no download): input ~ LogNormal(median 160, sigma 1.0), output ~ LogNormal(median 180,
  sigma 0.9), rounded, clipped to ``[4, max_input_len]`` and ``[4, 1024]`` (means ~260 and
  ~265 tokens; heavy right tail like the real set). ``output_len`` fixes all outputs instead.
* ``trace``: a request log (see ``fulcrum.analyze.trace``) replayed with its arrival times and
  its own endpoint per request (messages go to chat, token ids to completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fulcrum.tokenizer import special_token_ids


@dataclass
class Turn:
    """One request's own part: the user message (chat) or the prompt (completions)."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class Session:
    """A request or a conversation, started at its arrival and run turn after turn."""

    turns: list[Turn]
    system: str | list[int] | None = None  # system prompt (chat) / shared prompt prefix
    arrival_s: float | None = None  # trace replay: seconds after the trace's first request
    messages: list[dict[str, str]] | None = None  # trace chat requests: sent as they are
    endpoint: str | None = None  # trace: the record's endpoint; None: the benchmark's
    session_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class TokenSource:
    """Random prompts from the tokenizer's ordinary vocabulary, reproducible from a seed."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        banned = special_token_ids(tokenizer)
        vocab = len(tokenizer)
        self.allowed = np.asarray([i for i in range(vocab) if i not in banned], dtype=np.int64)
        if not len(self.allowed):
            raise ValueError("tokenizer has no ordinary tokens to build prompts from.")

    def ids(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.choice(self.allowed, size=max(n, 0))]

    def text(self, n: int) -> tuple[str, int]:
        """Text that re-encodes to ``n`` tokens (or as close as 8 refinements get)."""
        tok = self.tokenizer
        ids = self.ids(n)
        text = tok.decode(ids)
        for _ in range(8):
            enc = tok.encode(text, add_special_tokens=False)
            if len(enc) == n:
                break
            enc = enc[:n] if len(enc) > n else enc + self.ids(n - len(enc))
            text = tok.decode(enc)
        return text, len(tok.encode(text, add_special_tokens=False))

    def prompt(self, n: int, as_text: bool) -> tuple[str | list[int], int]:
        if as_text:
            return self.text(n)
        return self.ids(n), n


def _lengths(rng: np.random.Generator, mean: int, ratio: float, count: int) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}.")
    lo, hi = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return [int(x) for x in rng.integers(lo, hi + 1, size=count)]


def random_dataset(
    src: TokenSource, num: int, input_len: int, output_len: int, ratio: float, as_text: bool
) -> list[Session]:
    ins = _lengths(src.rng, input_len, ratio, num)
    outs = _lengths(src.rng, output_len, ratio, num)
    sessions = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        prompt, n = src.prompt(n_in, as_text)
        sessions.append(Session([Turn(prompt, n, n_out)], session_id=i))
    return sessions


def prefix_repetition_dataset(
    src: TokenSource,
    num: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    as_text: bool,
) -> list[Session]:
    if num_prefixes < 1:
        raise ValueError(f"number of prefixes must be at least 1, got {num_prefixes}.")
    prefixes = [src.prompt(prefix_len, as_text) for _ in range(num_prefixes)]
    sessions = []
    for i in range(num):
        prefix, n_prefix = prefixes[i % num_prefixes]
        suffix, n_suffix = src.prompt(suffix_len, as_text)
        sessions.append(
            Session(
                [Turn(suffix, n_suffix, output_len)],
                system=prefix,
                session_id=i,
                extra={"prefix_index": i % num_prefixes, "prefix_len": n_prefix},
            )
        )
    return sessions


def multi_turn_dataset(
    src: TokenSource,
    conversations: int,
    turns: int,
    input_len: int,
    output_len: int,
    system_len: int,
) -> list[Session]:
    if conversations < 1 or turns < 1:
        raise ValueError("multi-turn needs at least one conversation and one turn.")
    sessions = []
    for c in range(conversations):
        system = src.text(system_len)[0] if system_len > 0 else None
        user_turns = [Turn(*src.text(input_len), output_len) for _ in range(turns)]
        sessions.append(Session(user_turns, system=system, session_id=c))
    return sessions


def sharegpt_like_dataset(
    src: TokenSource,
    num: int,
    output_len: int | None,
    max_input_len: int,
    as_text: bool,
) -> list[Session]:
    rng = src.rng
    ins = np.clip(np.rint(rng.lognormal(np.log(160), 1.0, num)), 4, max(max_input_len, 4))
    outs = np.clip(np.rint(rng.lognormal(np.log(180), 0.9, num)), 4, 1024)
    sessions = []
    for i in range(num):
        prompt, n = src.prompt(int(ins[i]), as_text)
        n_out = output_len if output_len is not None else int(outs[i])
        sessions.append(Session([Turn(prompt, n, n_out)], session_id=i))
    return sessions


def trace_dataset(
    path: str, num: int | None, default_output_len: int, time_scale: float = 1.0
) -> list[Session]:
    """Sessions replaying ``path``; ``time_scale`` 2.0 replays twice as fast."""
    from fulcrum.analyze.overlap import ordered
    from fulcrum.analyze.trace import load_trace

    if time_scale <= 0:
        raise ValueError(f"trace speed-up must be positive, got {time_scale}.")
    records = ordered(load_trace(path))[: num if num else None]
    t0 = next((r.arrival_time for r in records if r.arrival_time is not None), None)
    sessions = []
    for i, r in enumerate(records):
        out = r.num_output_tokens if r.num_output_tokens else default_output_len
        arrival = None
        if t0 is not None and r.arrival_time is not None:
            arrival = (r.arrival_time - t0) / time_scale
        if r.endpoint == "chat" and r.messages:
            turn = Turn(r.messages[-1].get("content", ""), r.num_prompt_tokens, out)
            s = Session([turn], arrival_s=arrival, messages=r.messages, endpoint="chat")
        elif r.prompt_token_ids:
            turn = Turn(r.prompt_token_ids, len(r.prompt_token_ids), out)
            s = Session([turn], arrival_s=arrival, endpoint="completions")
        elif isinstance(r.prompt, str):
            turn = Turn(r.prompt, r.num_prompt_tokens, out)
            s = Session([turn], arrival_s=arrival, endpoint="completions")
        else:
            raise ValueError(f"trace {path}: request {r.request_id!r} has no prompt to replay.")
        s.session_id = i
        sessions.append(s)
    return sessions
