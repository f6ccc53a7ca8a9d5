"""Prefix overlap of a trace: replay it through ``RadixCacheSim`` and group the hits.

Records are replayed in arrival order (file order when times are missing). Groups:

* **per system prompt**: chat requests by the text of their first system message; requests
  without one fall in ``"(none)"``.
* **per conversation**: ``conversation_id`` when the log has it; otherwise a chat request's
  conversation is its system prompt plus its first user message (the turns of one
  conversation re-send both). Completions requests without an id are their own conversation.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from fulcrum.analyze.radix_sim import RadixCacheSim
from fulcrum.analyze.trace import TraceRecord


@dataclass
class GroupOverlap:
    """Hits of one group of requests."""

    key: str
    num_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def overlap(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "overlap": self.overlap}


@dataclass
class OverlapReport:
    """What the replay found, for one cache capacity."""

    capacity_tokens: int | None
    block_size: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    evicted_blocks: int
    per_request_hits: list[int] = field(repr=False)
    by_system_prompt: list[GroupOverlap]
    by_conversation: list[GroupOverlap]

    @property
    def overlap(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self, top: int = 10) -> dict:
        conv = self.by_conversation
        multi = [g for g in conv if g.num_requests > 1]
        return {
            "capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "overlap": self.overlap,
            "evicted_blocks": self.evicted_blocks,
            "num_system_prompts": len(self.by_system_prompt),
            "by_system_prompt": [g.to_dict() for g in self.by_system_prompt[:top]],
            "num_conversations": len(conv),
            "num_multi_turn_conversations": len(multi),
            "multi_turn_overlap": _pooled(multi),
            "by_conversation": [g.to_dict() for g in conv[:top]],
        }


def _pooled(groups: list[GroupOverlap]) -> float:
    p = sum(g.prompt_tokens for g in groups)
    return sum(g.hit_tokens for g in groups) / p if p else 0.0


def _short(text: str, n: int = 48) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 3] + "..."


def system_key(rec: TraceRecord) -> str:
    sp = rec.system_prompt
    if sp is None:
        return "(none)"
    digest = hashlib.sha1(sp.encode()).hexdigest()[:8]
    return f"{digest} {_short(sp)!r}"


def conversation_key(rec: TraceRecord) -> str:
    if rec.conversation_id is not None:
        return rec.conversation_id
    if rec.messages:
        first_user = next((m["content"] for m in rec.messages if m["role"] == "user"), "")
        raw = f"{rec.system_prompt}\x00{first_user}"
        return "chat-" + hashlib.sha1(raw.encode()).hexdigest()[:12]
    return f"req-{rec.request_id}"


def ordered(records: list[TraceRecord]) -> list[TraceRecord]:
    """Arrival order; records without a time keep their file position (stable sort)."""
    if all(r.arrival_time is not None for r in records):
        return sorted(records, key=lambda r: r.arrival_time or 0.0)
    return list(records)


def simulate_overlap(
    records: list[TraceRecord], capacity_tokens: int | None, block_size: int = 16
) -> OverlapReport:
    """Replay tokenized records through a cache of ``capacity_tokens`` (None: unbounded)."""
    sim = RadixCacheSim(capacity_tokens, block_size)
    by_sys: dict[str, GroupOverlap] = {}
    by_conv: dict[str, GroupOverlap] = {}
    hits: list[int] = []
    for rec in ordered(records):
        if rec.prompt_token_ids is None:
            raise ValueError(f"request {rec.request_id!r} is not tokenized.")
        hit = sim.access(rec.prompt_token_ids, rec.cache_salt)
        hits.append(hit)
        for table, key in ((by_sys, system_key(rec)), (by_conv, conversation_key(rec))):
            g = table.setdefault(key, GroupOverlap(key))
            g.num_requests += 1
            g.prompt_tokens += len(rec.prompt_token_ids)
            g.hit_tokens += hit
    st = sim.stats
    return OverlapReport(
        capacity_tokens=capacity_tokens,
        block_size=block_size,
        num_requests=st.num_requests,
        prompt_tokens=st.prompt_tokens,
        hit_tokens=st.hit_tokens,
        evicted_blocks=st.evicted_blocks,
        per_request_hits=hits,
        by_system_prompt=sorted(by_sys.values(), key=lambda g: -g.prompt_tokens),
        by_conversation=sorted(by_conv.values(), key=lambda g: -g.prompt_tokens),
    )
