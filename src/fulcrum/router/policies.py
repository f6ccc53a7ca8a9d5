"""Routing policies: which worker of a pool gets a request.

``choose`` sees only the pool's available workers (breaker closed, or open and due a probe) and
the request's prompt text; ``exclude`` holds workers already tried for this request (a retry goes
elsewhere when it can)."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

from fulcrum.router.config import RouterConfig
from fulcrum.router.prefix_tree import block_hashes
from fulcrum.router.worker import Worker


@dataclass
class Routed:
    worker: Worker
    matched_chars: int = 0  # cache_aware: the estimated cached prefix on that worker


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, workers: list[Worker], text: str) -> Routed:
        """Pick one of ``workers`` (non-empty) for a request whose prompt text is ``text``."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: list[Worker], text: str) -> Routed:
        w = workers[self._next % len(workers)]
        self._next += 1
        return Routed(w)


class LeastLoad(Policy):
    """Power of two choices: two workers at random, the one with fewer outstanding requests
    (``Worker.load``: the router's count or the worker's reported running + waiting)."""

    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: list[Worker], text: str) -> Routed:
        if len(workers) == 1:
            return Routed(workers[0])
        a, b = self._rng.sample(workers, 2)
        return Routed(a if a.load <= b.load else b)


def cache_aware_pick(
    loads: list[int],
    matches: list[int],
    tree_chars: list[int],
    text_chars: int,
    *,
    cache_threshold: float,
    balance_abs: int,
    balance_rel: float,
) -> int:
    """The cache-aware rule on plain numbers (shared with the Ray Serve request router): the
    index of the chosen candidate, given each one's load, matched prefix and tree size."""
    lo, hi = min(loads), max(loads)
    if hi - lo > balance_abs and hi > balance_rel * lo:
        return loads.index(lo)
    n = len(loads)
    best = max(range(n), key=lambda j: (matches[j], -loads[j]))
    if text_chars and matches[best] / text_chars >= cache_threshold:
        return best
    return min(range(n), key=lambda j: (tree_chars[j], loads[j]))


class CacheAware(Policy):
    """SGLang router's rule: when the in-flight spread is small, send the request to the worker
    whose tree matches the longest prefix (if the match covers ``cache_threshold`` of the prompt;
    otherwise to the worker with the smallest tree, which has the most room); when the spread
    exceeds both thresholds, to the least loaded worker. The chosen worker's tree then holds the
    prompt."""

    name = "cache_aware"

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.prompt_chars = 0
        self.matched_chars = 0

    @property
    def hit_rate(self) -> float:
        """Estimated share of routed prompt text found in the chosen worker's cache."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    def choose(self, workers: list[Worker], text: str) -> Routed:
        cfg = self.cfg
        hashes = block_hashes(text, cfg.cache_block_chars)
        loads = [w.in_flight for w in workers]
        matches = [w.tree.match(hashes) for w in workers]
        i = cache_aware_pick(
            loads,
            matches,
            [w.tree.size_chars for w in workers],
            len(text),
            cache_threshold=cfg.cache_threshold,
            balance_abs=cfg.balance_abs_threshold,
            balance_rel=cfg.balance_rel_threshold,
        )
        w = workers[i]
        w.tree.insert(hashes)
        self.prompt_chars += len(text)
        self.matched_chars += matches[i]
        return Routed(w, matches[i])


def make_policy(name: str, cfg: RouterConfig) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(cfg)
    raise ValueError(f"unknown policy {name!r}")
