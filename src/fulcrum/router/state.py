"""The router's live state: pools of workers with their policies, changed at run time by
``POST/DELETE /workers``. Everything runs on one event loop, so no locks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fulcrum.router.breaker import CircuitBreaker
from fulcrum.router.config import RouterConfig
from fulcrum.router.metrics import RouterMetrics
from fulcrum.router.policies import CacheAware, Policy, Routed, make_policy
from fulcrum.router.prefix_tree import PrefixTree
from fulcrum.router.shape import (
    CHARS_PER_TOKEN,
    PrefixGroups,
    RequestShape,
    classify,
    output_tokens,
    prompt_text,
)
from fulcrum.router.worker import Worker


class NoWorkerError(RuntimeError):
    """No available worker in the pool a request belongs to."""


@dataclass
class Pool:
    name: str
    policy: Policy
    workers: list[Worker] = field(default_factory=list)


class RouterState:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.pools: dict[str, Pool] = {
            p.name: Pool(p.name, make_policy(p.policy, cfg)) for p in cfg.pools
        }
        self.groups = PrefixGroups(cfg.prefix_chars)
        self.metrics = RouterMetrics(self._snapshot)
        for p in cfg.pools:
            for spec in p.workers:
                self.add_worker(spec.url, p.name, spec.api_key)

    # -- workers ---------------------------------------------------------------------------
    def workers(self) -> list[Worker]:
        return [w for p in self.pools.values() for w in p.workers]

    def find(self, url: str) -> Worker | None:
        url = url.rstrip("/")
        return next((w for w in self.workers() if w.url == url), None)

    def add_worker(self, url: str, pool: str | None = None, api_key: str | None = None) -> Worker:
        pool = pool or self.cfg.default_pool
        if pool not in self.pools:
            raise ValueError(f"pool: no pool named {pool!r}")
        if self.find(url) is not None:
            raise ValueError(f"url: worker {url!r} is already routed to")
        cfg = self.cfg
        w = Worker(
            url=url.rstrip("/"),
            pool=pool,
            api_key=api_key,
            breaker=CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s),
            tree=PrefixTree(cfg.cache_block_chars, cfg.cache_max_chars),
        )
        self.pools[pool].workers.append(w)
        return w

    def remove_worker(self, url: str) -> Worker:
        w = self.find(url)
        if w is None:
            raise KeyError(url)
        self.pools[w.pool].workers.remove(w)
        return w

    # -- routing ---------------------------------------------------------------------------
    def pool_for(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[Pool, str]:
        """The request's pool and its prompt text."""
        text = prompt_text(body)
        if self.cfg.policy != "shape":
            return self.pools[self.cfg.default_pool], text
        shape = RequestShape(
            prompt_tokens=len(text) // CHARS_PER_TOKEN,
            output_tokens=output_tokens(body),
            stream=bool(body.get("stream")),
            prefix_count=self.groups.observe(text),
            headers=headers,
        )
        return self.pools[classify(self.cfg.rules, shape, self.cfg.default_pool)], text

    def choose(self, pool: Pool, text: str, exclude: set[Worker]) -> Routed:
        live = [w for w in pool.workers if w.available()]
        fresh = [w for w in live if w not in exclude]
        candidates = fresh or live
        if not candidates:
            raise NoWorkerError(f"no available worker in pool {pool.name!r}")
        return pool.policy.choose(candidates, text)

    def _snapshot(self) -> tuple[list[Worker], dict[str, float | None]]:
        rates = {
            name: (p.policy.hit_rate if isinstance(p.policy, CacheAware) else None)
            for name, p in self.pools.items()
        }
        return self.workers(), rates

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.cfg.policy,
            "pools": {
                name: {"policy": p.policy.name, "workers": [w.to_dict() for w in p.workers]}
                for name, p in self.pools.items()
            },
        }
