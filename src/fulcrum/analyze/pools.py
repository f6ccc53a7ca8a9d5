"""Which request shapes a trace holds and what share of requests each gets: the pools to run
behind ``fulcrum router --policy shape``, classified with the router's own shape rules."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from fulcrum.analyze.trace import TraceRecord
from fulcrum.router.config import ShapeRule
from fulcrum.router.shape import RequestShape, classify

PREFIX_TOKENS = 64  # leading tokens that name a prefix group
MIN_GROUP = 4  # requests sharing them before the group counts as prefix-heavy
MIN_SHARE = 0.05  # shapes below this share of requests are served by the default pool

# (pool, inner policy, rule) in match order; "interactive" takes what no rule matches.
SHAPES: list[tuple[str, str, ShapeRule | None]] = [
    ("long_generation", "least_load", ShapeRule("long_generation", min_output_tokens=512)),
    ("prefix_heavy", "cache_aware", ShapeRule("prefix_heavy", min_prefix_count=MIN_GROUP)),
    ("long_prompt", "least_load", ShapeRule("long_prompt", min_prompt_tokens=2048)),
    ("interactive", "least_load", None),
]


@dataclass
class PoolAdvice:
    pool: str
    policy: str
    num_requests: int
    share: float
    why: str


def recommend_pools(records: list[TraceRecord]) -> list[PoolAdvice]:
    """The shapes with at least ``MIN_SHARE`` of requests (the rest fold into ``interactive``)."""
    keys = [tuple((r.prompt_token_ids or [])[:PREFIX_TOKENS]) for r in records]
    group_size = Counter(k for k in keys if len(k) == PREFIX_TOKENS)
    rules = tuple(rule for _, _, rule in SHAPES if rule is not None)
    counts: Counter[str] = Counter()
    for r, k in zip(records, keys, strict=True):
        shape = RequestShape(
            prompt_tokens=r.num_prompt_tokens,
            output_tokens=r.num_output_tokens,
            stream=False,
            prefix_count=group_size.get(k, 1),
            headers={},
        )
        counts[classify(rules, shape, "interactive")] += 1
    n = len(records)
    small = [p for p in counts if p != "interactive" and counts[p] / n < MIN_SHARE]
    for p in small:
        counts["interactive"] += counts.pop(p)
    why = {
        "long_generation": "outputs of 512+ tokens: throughput-tuned workers, least loaded first",
        "prefix_heavy": f"share their first {PREFIX_TOKENS} tokens with {MIN_GROUP - 1}+ others:"
        " cache_aware keeps each group on the worker that holds its prefix",
        "long_prompt": "prompts of 2048+ tokens: prefill-heavy, kept off the interactive pool",
        "interactive": "short requests: least loaded worker",
    }
    return [
        PoolAdvice(pool, policy, counts[pool], counts[pool] / n, why[pool])
        for pool, policy, _ in SHAPES
        if counts[pool]
    ]


def pools_to_dict(advice: list[PoolAdvice]) -> list[dict]:
    return [asdict(a) for a in advice]


def render_pools(advice: list[PoolAdvice]) -> list[str]:
    lines = ["", "Router pools (fulcrum router --policy shape):"]
    for a in advice:
        lines.append(
            f"  {a.share:6.1%}  {a.num_requests:6d} req  {a.pool:<16} {a.policy:<12} {a.why}"
        )
    if len(advice) == 1:
        lines.append("  one shape: a single pool (any policy) serves this trace")
    return lines
