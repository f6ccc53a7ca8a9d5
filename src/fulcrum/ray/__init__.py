"""Replicas on Ray Serve: ``fulcrum serve --ray`` and ``fulcrum.ray.build_app(...)``.

N engine replicas run as one Ray Serve deployment behind a small FastAPI ingress; the ingress's
handle routes each request with :class:`~fulcrum.ray.request_router.CacheAwareRequestRouter` (the
router's cache-aware rule over Ray Serve's request-router API). Ray is an optional extra
(``pip install fulcrum[ray]``): this package imports it only when it is used, so the rest of
fulcrum imports without it."""

from __future__ import annotations

from typing import Any

from fulcrum.ray.config import RayServeConfig, require_ray

__all__ = ["RayServeConfig", "build_app", "require_ray"]


def build_app(*args: Any, **kwargs: Any) -> Any:
    """A Ray Serve application of fulcrum engine replicas; see :func:`fulcrum.ray.app.build_app`."""
    require_ray()
    from fulcrum.ray.app import build_app as _build_app

    return _build_app(*args, **kwargs)
