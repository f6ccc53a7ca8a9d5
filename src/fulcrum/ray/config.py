"""Settings of a fulcrum application on Ray Serve, with every default here, and the one place
that imports ``ray`` (lazily, with a clear message when the extra is missing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulcrum.router.config import RouterConfig

RAY_EXTRA_HINT = "Ray Serve is not installed: pip install fulcrum[ray]"
APP_NAME = "fulcrum"


def require_ray() -> Any:
    """Import ``ray.serve``; without it, ImportError naming the extra to install."""
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError as e:
        raise ImportError(f"{RAY_EXTRA_HINT} ({e})") from e
    return serve


def _router_default(name: str) -> Any:
    return RouterConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class RayServeConfig:
    num_replicas: int = 1  # engine replicas (with min/max: the initial count, clamped into them)
    min_replicas: int | None = None  # either bound set: Ray Serve autoscaling between them
    max_replicas: int | None = None
    # None: this many per replica when the cluster has GPUs (tensor_parallel_size), else 0
    num_gpus: float | None = None
    num_cpus: float = 1.0  # per replica when it runs on the CPU (logical Ray resources)
    ingress_replicas: int = 1  # FastAPI front replicas (each routes with its own trees)
    ingress_num_cpus: float = 0.5
    # Requests Serve may send one replica at once; None: what its server admits (max_num_seqs +
    # max_queued_requests), so queueing happens in the engine, where it batches.
    max_ongoing_requests: int | None = None
    # Autoscaling target of in-flight requests per replica; None: max_num_seqs (a full batch).
    target_ongoing_requests: float | None = None
    request_router: str = "fulcrum.ray.request_router.CacheAwareRequestRouter"
    # cache-aware routing: the router's own defaults (fulcrum.router.config.RouterConfig)
    cache_threshold: float = _router_default("cache_threshold")
    balance_abs_threshold: int = _router_default("balance_abs_threshold")
    balance_rel_threshold: float = _router_default("balance_rel_threshold")
    cache_block_chars: int = _router_default("cache_block_chars")
    cache_max_chars: int = _router_default("cache_max_chars")

    def __post_init__(self) -> None:
        for name in ("num_replicas", "ingress_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0:
            raise ValueError(f"min_replicas must be at least 0, got {lo}")
        if hi is not None and hi < 1:
            raise ValueError(f"max_replicas must be at least 1, got {hi}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"min_replicas ({lo}) must not exceed max_replicas ({hi})")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas: a missing bound defaults to 1 below and num_replicas above."""
        lo = 1 if self.min_replicas is None else self.min_replicas
        hi = max(lo, self.num_replicas) if self.max_replicas is None else self.max_replicas
        return lo, hi

    @property
    def initial_replicas(self) -> int:
        lo, hi = self.bounds
        return min(max(self.num_replicas, lo), hi)

    def router_kwargs(self) -> dict[str, Any]:
        return {
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "block_chars": self.cache_block_chars,
            "max_chars": self.cache_max_chars,
        }
