"""``build_app``: fulcrum engine replicas as a Ray Serve application.

::

    HTTP ─► Serve proxy ─► Ingress (FastAPI) ──handle──► EngineReplica x N
                           prompt text ─► CacheAwareRequestRouter picks the replica

Run it with ``serve.run(build_app(...), route_prefix="/")`` on a running Ray cluster, or with
``fulcrum serve --ray``."""

from __future__ import annotations

import dataclasses
from typing import Any

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.entrypoints.openai.serving_base import ServeOptions
from fulcrum.model.loader.default_model import DEFAULT_MODEL_NAME
from fulcrum.ray.config import RayServeConfig, require_ray


def default_options(engine_args: EngineArgs) -> ServeOptions:
    name = engine_args.model or DEFAULT_MODEL_NAME
    return ServeOptions(
        served_model_names=[name], model_root=name, max_num_seqs=engine_args.max_num_seqs
    )


def _replica_gpus(cfg: RayServeConfig, engine_args: EngineArgs) -> float:
    if cfg.num_gpus is not None:
        return cfg.num_gpus
    if engine_args.device == "cpu":
        return 0.0
    per_replica = float(engine_args.tensor_parallel_size)
    if engine_args.device.startswith("cuda"):
        return per_replica
    import ray

    if ray.is_initialized():
        return per_replica if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch

    return per_replica if torch.cuda.is_available() else 0.0


def deployment_options(
    cfg: RayServeConfig, engine_args: EngineArgs, options: ServeOptions
) -> dict[str, Any]:
    """The engine deployment's Serve options: resources, replica count or autoscaling bounds,
    queue limits and the request router."""
    from ray.serve.config import RequestRouterConfig

    gpus = _replica_gpus(cfg, engine_args)
    actor: dict[str, Any] = {"num_gpus": gpus} if gpus else {"num_cpus": cfg.num_cpus}
    if gpus:
        actor["num_cpus"] = 1
    max_ongoing = cfg.max_ongoing_requests or options.max_num_seqs + options.max_queued_requests
    opts: dict[str, Any] = {
        "ray_actor_options": actor,
        "max_ongoing_requests": max_ongoing,
        # Loading weights (and capturing graphs on a GPU) takes a while: give health checks room.
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": options.shutdown_timeout,
        "request_router_config": RequestRouterConfig(
            request_router_class=cfg.request_router,
            request_router_kwargs=cfg.router_kwargs(),
        ),
    }
    if cfg.autoscaling:
        lo, hi = cfg.bounds
        opts["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": cfg.initial_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests or options.max_num_seqs,
        }
    else:
        opts["num_replicas"] = cfg.num_replicas
    return opts


def build_app(
    engine_args: EngineArgs | None = None,
    options: ServeOptions | None = None,
    config: RayServeConfig | None = None,
    **overrides: Any,
) -> Any:
    """A Ray Serve application serving the OpenAI API from N engine replicas.

    ``overrides`` set fields of :class:`RayServeConfig` (``num_replicas=2``,
    ``min_replicas=1, max_replicas=4``, ...) or of :class:`EngineArgs` (``model=...``,
    ``max_model_len=...``); ``options`` are the server's (API key, limits), as ``fulcrum serve``
    builds them."""
    serve = require_ray()
    from fulcrum.ray.ingress import Ingress
    from fulcrum.ray.replica import EngineReplica

    ray_fields = {f.name for f in dataclasses.fields(RayServeConfig)}
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = set(overrides) - ray_fields - engine_fields
    if unknown:
        raise TypeError(f"build_app: unknown argument(s) {sorted(unknown)}")
    cfg = dataclasses.replace(
        config or RayServeConfig(), **{k: v for k, v in overrides.items() if k in ray_fields}
    )
    engine_args = dataclasses.replace(
        engine_args or EngineArgs(),
        **{k: v for k, v in overrides.items() if k in engine_fields},
    )
    options = options or default_options(engine_args)
    engine = serve.deployment(EngineReplica, name="FulcrumEngine").options(
        **deployment_options(cfg, engine_args, options)
    )
    ingress = serve.deployment(Ingress, name="FulcrumIngress").options(
        num_replicas=cfg.ingress_replicas,
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
        max_ongoing_requests=max(1000, options.max_queued_requests),
    )
    return ingress.bind(engine.bind(engine_args, options))
