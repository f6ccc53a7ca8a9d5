"""``fulcrum serve --ray``: the server's flags plus the Ray ones, run as a Ray Serve application.

``cli_serve`` adds these flags to ``fulcrum serve`` and hands over to :func:`run_serve_ray` when
any of them is given; nothing here imports Ray until the command runs."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.ray.config import APP_NAME, RayServeConfig

_RAY_ONLY = ("num_replicas", "ray_address", "min_replicas", "max_replicas")


def _at_least(low: int) -> Any:
    def parse(value: str) -> int:
        n = int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    parse.__name__ = "int"
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ray serve (needs: pip install fulcrum[ray])")
    g.add_argument(
        "--ray",
        action="store_true",
        help="Serve from engine replicas on Ray Serve (one engine per replica, each with its "
        "GPU, or CPUs without one), routed by a cache-aware request router; --host and --port "
        "are Serve's HTTP proxy.",
    )
    g.add_argument(
        "--num-replicas",
        type=_at_least(1),
        default=None,
        help="With --ray: engine replicas to run (with --min/--max-replicas: the initial count) "
        "(default: 1).",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="With --ray: the Ray cluster to join (e.g. ray://head:10001 or head:6379); fulcrum "
        "must be installed on its nodes (default: $RAY_ADDRESS, else start a local cluster).",
    )
    g.add_argument(
        "--min-replicas",
        type=_at_least(0),
        default=None,
        help="With --ray: autoscale, never below this many replicas (Ray Serve's "
        "autoscaling_config.min_replicas; default without --max-replicas: no autoscaling).",
    )
    g.add_argument(
        "--max-replicas",
        type=_at_least(1),
        default=None,
        help="With --ray: autoscale, never above this many replicas (Ray Serve's "
        "autoscaling_config.max_replicas; target: --max-num-seqs requests in flight each).",
    )


def wanted(args: argparse.Namespace) -> bool:
    """Whether the Ray path handles this command (``--ray``, or a Ray flag given without it)."""
    return bool(args.ray) or any(getattr(args, n) is not None for n in _RAY_ONLY)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _config(args: argparse.Namespace) -> RayServeConfig:
    return RayServeConfig(
        num_replicas=args.num_replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
    )


def run_serve_ray(args: argparse.Namespace, options: Any, engine_args: EngineArgs) -> int:
    """Deploy the replicas, print how to call them, and serve until SIGINT/SIGTERM."""
    if not args.ray:
        given = [_flag(n) for n in _RAY_ONLY if getattr(args, n) is not None]
        print(f"fulcrum serve: error: {', '.join(given)} need(s) --ray", file=sys.stderr)
        return 2
    if args.api_server_count > 1:
        print("fulcrum serve: error: --api-server-count does not apply with --ray", file=sys.stderr)
        return 2
    try:
        cfg = _config(args)
        from fulcrum.ray.config import require_ray

        serve = require_ray()
    except (ValueError, ImportError) as e:
        print(f"fulcrum serve: error: {e}", file=sys.stderr)
        return 2
    import ray

    from fulcrum.entrypoints.openai.api_process import usage_banner
    from fulcrum.ray.app import build_app

    local = args.ray_address is None and not os.environ.get("RAY_ADDRESS")
    ray.init(address=args.ray_address, include_dashboard=False if local else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(engine_args, options, cfg), name=APP_NAME, route_prefix="/")
        print(
            usage_banner(
                args.host, args.port, options.served_model_names[0], bool(options.api_key)
            ),
            flush=True,
        )
        stop.wait()
    finally:
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()
            ray.shutdown()
    return 0
