"""A request's shape (prompt length, requested output, prefix group, streaming, headers) and the
rules that send each shape to a pool. ``fulcrum analyze`` classifies traces with the same rules."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fulcrum.router.config import ShapeRule

CHARS_PER_TOKEN = 4  # the router does not tokenize; English text averages about 4 characters


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    output_tokens: int | None  # max_tokens / max_completion_tokens, if the request sets one
    stream: bool
    prefix_count: int  # requests seen with the same leading text, this one included
    headers: Mapping[str, str]


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a worker will prefill, approximately: chat messages joined role by role (so
    requests sharing a system prompt share a leading text), or the completion prompt."""
    messages = body.get("messages")
    if "query" in body or "text_1" in body:  # rerank, score: the text every pair starts with
        first = body.get("query", body.get("text_1"))
        body = {"prompt": first if isinstance(first, str) else (first or [""])[0]}
    items = body.get("input")
    if isinstance(items, list) and items and not isinstance(items[0], dict):
        body = {"prompt": items}  # embeddings: strings or token ids, read as a completion prompt
    elif items is not None and messages is None:  # the Responses API: instructions, then input
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        messages = system + (items if isinstance(items, list) else [])
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            c = m.get("output", m.get("arguments")) if c is None else c  # a Responses tool item
            parts.append(f"<{m.get('role', m.get('type', ''))}>{'' if c is None else c}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):  # token ids: one character per id keeps prefixes aligned
            return "".join(chr(0x100 + (t % 0x10000)) for t in prompt)
        if isinstance(first, list):
            return "".join(chr(0x100 + (t % 0x10000)) for t in first if isinstance(t, int))
    return ""


def output_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


class PrefixGroups:
    """Counts requests by their leading ``prefix_chars`` characters (a bounded LRU of keys)."""

    def __init__(self, prefix_chars: int = 256, max_keys: int = 100_000) -> None:
        self.prefix_chars = prefix_chars
        self.max_keys = max_keys
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def observe(self, text: str) -> int:
        if len(text) < self.prefix_chars:
            return 1  # too short to share a meaningful prefix
        key = hashlib.blake2b(text[: self.prefix_chars].encode(), digest_size=12).digest()
        n = self._counts.pop(key, 0) + 1
        self._counts[key] = n
        while len(self._counts) > self.max_keys:
            self._counts.popitem(last=False)
        return n


def matches(rule: ShapeRule, s: RequestShape) -> bool:
    def within(v: int | None, lo: int | None, hi: int | None) -> bool:
        if lo is None and hi is None:
            return True
        if v is None:
            return False
        return (lo is None or v >= lo) and (hi is None or v <= hi)

    if not within(s.prompt_tokens, rule.min_prompt_tokens, rule.max_prompt_tokens):
        return False
    if not within(s.output_tokens, rule.min_output_tokens, rule.max_output_tokens):
        return False
    if rule.stream is not None and rule.stream != s.stream:
        return False
    if rule.min_prefix_count is not None and s.prefix_count < rule.min_prefix_count:
        return False
    if rule.header is not None:
        value = s.headers.get(rule.header.lower())
        if value is None or (rule.header_value is not None and value != rule.header_value):
            return False
    return True


def classify(rules: tuple[ShapeRule, ...] | list[ShapeRule], s: RequestShape, default: str) -> str:
    """The pool of the first matching rule, else ``default``."""
    for rule in rules:
        if matches(rule, s):
            return rule.pool
    return default
