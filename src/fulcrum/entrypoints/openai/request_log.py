"""Opt-in request log (``--log-requests-file``): one JSON object per finished request.

It is the input of the traffic analyzer, so its fields are a contract:
``request_id, arrival_time (unix s), endpoint ("chat" | "completions"), model,
prompt_token_ids, prompt (str | null), messages (list | null), num_prompt_tokens,
num_output_tokens, num_cached_tokens, ttft_s, e2e_s, finish_reason, cache_salt,
conversation_id``. Aborted requests (client gone) are logged with ``finish_reason: "abort"``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec


class RequestRecord(msgspec.Struct):
    request_id: str
    arrival_time: float
    endpoint: str
    model: str
    prompt_token_ids: list[int]
    prompt: str | None
    messages: list[dict[str, Any]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    finish_reason: str | None
    cache_salt: str | None
    conversation_id: str | None


class RequestLog:
    """Appends records as JSON lines; safe to call from the event loop (small, line-buffered)."""

    def __init__(self, path: str) -> None:
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._enc = msgspec.json.Encoder()
        self._lock = threading.Lock()

    def write(self, record: RequestRecord) -> None:
        line = self._enc.encode(record) + b"\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()
