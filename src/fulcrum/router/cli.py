"""``fulcrum router``: flags, or a YAML/JSON pool config, into a running router."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fulcrum.router.config import (
    POLICIES,
    ConfigError,
    RouterConfig,
    load_config_file,
    parse_config,
)


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:  # the OS would bind the value modulo 65536
        raise argparse.ArgumentTypeError(f"must be 0 to 65535, got {port}")
    return port


_port.__name__ = "int"  # argparse names the type in "invalid int value"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router",
        help="Route OpenAI requests over many workers (cache-, load- and shape-aware).",
        description="An OpenAI-compatible front (/v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/embeddings, /classify, /v1/score, /v1/rerank, /v1/models, "
        "/health, /metrics; /v1/load_lora_adapter and /v1/unload_lora_adapter go to every "
        "worker) over fulcrum, vLLM, SGLang or any OpenAI-compatible "
        "workers, with retries, circuit breakers and run-time worker changes (/workers).",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: %(default)s).")
    p.add_argument(
        "--port", type=_port, default=8080, help="TCP port, 0 to 65535 (default: %(default)s)."
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="A worker's base URL (http://host:port); repeat for each. Joins the default pool.",
    )
    p.add_argument(
        "--worker-api-key",
        default=None,
        help="Key sent upstream to the --worker URLs (the config file sets one per worker).",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="How to pick a worker: round_robin, least_load (power of two choices), "
        "cache_aware (longest cached prefix unless load is imbalanced) or shape (pools by "
        "request shape; needs --config). Default: the config's, else round_robin.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML or JSON file with pools, their policies and workers, shape rules and "
        "fault settings (flags given here override its top-level keys).",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="Key clients must send (Authorization: Bearer KEY); also guards POST/DELETE "
        "/workers (default: $FULCRUM_ROUTER_API_KEY, else no key and no /workers changes).",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=None,
        help="Other workers tried when one fails before the first byte (default: 2).",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=None,
        dest="health_interval_s",
        help="Seconds between health and load checks of each worker (default: 2).",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level (default: %(default)s).",
    )
    p.set_defaults(func=run_router)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    data: dict[str, Any] = load_config_file(args.config) if args.config else {}
    if args.worker:
        if "pools" in data:
            raise ConfigError("--worker adds to a single pool; list workers in the config's pools")
        workers = [{"url": u, "api_key": args.worker_api_key} for u in args.worker]
        data["workers"] = list(data.get("workers", [])) + workers
    return parse_config(
        data,
        policy=args.policy,
        api_key=args.api_key or os.environ.get("FULCRUM_ROUTER_API_KEY") or None,
        max_retries=args.max_retries,
        health_interval_s=args.health_interval_s,
    )


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from fulcrum.router.app import build_app

    try:
        cfg = config_from_args(args)
    except (ConfigError, OSError) as e:
        print(f"fulcrum router: error: {e}", file=sys.stderr)
        return 2
    if not any(p.workers for p in cfg.pools):
        print("fulcrum router: note: no workers yet; add them with POST /workers", file=sys.stderr)
    uvicorn.run(
        build_app(cfg),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0
