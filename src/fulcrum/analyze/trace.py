"""Request-log reader shared by ``fulcrum analyze`` and the ``trace`` benchmark dataset.

Two line formats are accepted, one JSON object per line (blank lines are skipped):

1. The server's ``--log-requests-file`` JSONL (the contract with ``fulcrum serve``)::

       {"request_id": str, "arrival_time": float (unix s), "endpoint": "chat"|"completions",
        "model": str, "prompt_token_ids": [int], "prompt": str|null, "messages": list|null,
        "num_prompt_tokens": int, "num_output_tokens": int, "num_cached_tokens": int,
        "ttft_s": float|null, "e2e_s": float, "finish_reason": str,
        "cache_salt": str|null, "conversation_id": str|null}

   A line is of this kind when it has ``prompt_token_ids`` or ``num_prompt_tokens``.

2. Plain OpenAI request bodies: ``{"model", "messages", ...}`` (chat) or ``{"model", "prompt",
   ...}`` (completions; the prompt may be a string or a list of token ids). They are tokenized
   with the given tokenizer (chat through ``apply_chat_template``). Optional extra keys are
   honoured: ``arrival_time`` / ``timestamp`` (unix s), ``conversation_id``, ``cache_salt``,
   ``max_tokens`` / ``max_completion_tokens`` (the output length when no usage is known).

Anything else (invalid JSON, a non-object, no prompt) is a ``TraceError`` naming the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class TraceError(ValueError):
    """A malformed trace; the message is one line naming the file and line number."""


@dataclass
class TraceRecord:
    """One request of a trace, normalised."""

    request_id: str
    arrival_time: float | None
    endpoint: str  # "chat" | "completions"
    prompt_token_ids: list[int] | None  # None until tokenized
    num_prompt_tokens: int
    num_output_tokens: int | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    model: str | None = None
    num_cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    cache_salt: str | None = None
    conversation_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def system_prompt(self) -> str | None:
        """The text of the first system message of a chat request, if any."""
        for m in self.messages or []:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                return _content_text(m.get("content"))
        return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return "" if content is None else str(content)


def normalise_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Messages with string contents, as chat templates expect."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message must be an object with a 'role'")
        out.append({"role": str(m["role"]), "content": _content_text(m.get("content"))})
    return out


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _parse_line(obj: Any, lineno: int) -> TraceRecord:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    arrival = obj.get("arrival_time", obj.get("timestamp"))
    rid = str(obj.get("request_id", obj.get("id", f"line-{lineno}")))
    messages = obj.get("messages")
    prompt = obj.get("prompt")
    if messages is not None and not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    endpoint = obj.get("endpoint") or ("chat" if messages is not None else "completions")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"unknown endpoint {endpoint!r}")
    ids = obj.get("prompt_token_ids")
    if ids is None and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = prompt
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("'prompt_token_ids' must be a list of integers")
    elif messages is None and not isinstance(prompt, str):
        raise ValueError("no 'prompt_token_ids', 'messages' or 'prompt'")
    n_prompt = obj.get("num_prompt_tokens")
    n_out = obj.get("num_output_tokens")
    if n_out is None:
        n_out = obj.get("max_completion_tokens", obj.get("max_tokens"))
    return TraceRecord(
        request_id=rid,
        arrival_time=_opt_float(arrival),
        endpoint=endpoint,
        prompt_token_ids=list(ids) if ids is not None else None,
        num_prompt_tokens=int(n_prompt) if n_prompt is not None else len(ids or []),
        num_output_tokens=_opt_int(n_out),
        messages=normalise_messages(messages) if messages is not None else None,
        prompt=prompt,
        model=obj.get("model"),
        num_cached_tokens=_opt_int(obj.get("num_cached_tokens")),
        ttft_s=_opt_float(obj.get("ttft_s")),
        e2e_s=_opt_float(obj.get("e2e_s")),
        cache_salt=obj.get("cache_salt"),
        conversation_id=(
            str(obj["conversation_id"]) if obj.get("conversation_id") is not None else None
        ),
    )


def iter_trace(path: str) -> Iterator[TraceRecord]:
    """Yield the records of a JSONL trace; raise ``TraceError`` on the first bad line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path!r}: {e.strerror or e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _parse_line(json.loads(line), lineno)
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise TraceError(f"{path}:{lineno}: malformed trace line: {msg}") from None


def tokenize_record(rec: TraceRecord, tokenizer: Any) -> list[int]:
    """Fill and return ``rec.prompt_token_ids`` (chat through the tokenizer's chat template)."""
    if rec.prompt_token_ids is None:
        if rec.messages is not None:
            text = tokenizer.apply_chat_template(
                rec.messages, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(str(rec.prompt), add_special_tokens=True)
        rec.prompt_token_ids = [int(t) for t in ids]
        rec.num_prompt_tokens = len(rec.prompt_token_ids)
    return rec.prompt_token_ids


def load_trace(path: str, tokenizer: Any | None = None) -> list[TraceRecord]:
    """Read a whole trace; tokenize records lacking token ids when a tokenizer is given.

    Records without arrival times keep ``None``; an empty trace is an error.
    """
    records = list(iter_trace(path))
    if not records:
        raise TraceError(f"trace {path!r} holds no requests.")
    if tokenizer is not None:
        for rec in records:
            tokenize_record(rec, tokenizer)
    return records


def needs_tokenizer(records: list[TraceRecord]) -> bool:
    return any(r.prompt_token_ids is None for r in records)
