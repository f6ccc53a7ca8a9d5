"""One HTTP server process: the app, uvicorn, and the engine core it talks to."""

from __future__ import annotations

import argparse
import logging
from typing import Any


def usage_banner(host: str, port: int, model: str, has_key: bool, tls: bool = False) -> str:
    """How to call the server, printed once it accepts requests."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"{'https' if tls else 'http'}://{shown}:{port}/v1"
    auth = ' -H "Authorization: Bearer $FULCRUM_API_KEY"' if has_key else ""
    key = "os.environ['FULCRUM_API_KEY']" if has_key else "'unused'"
    return (
        f"\nfulcrum is serving {model!r} at {base}\n\n"
        f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", '
        f'"content": "Hello!"}}]}}\'\n\n'
        f'  python -c "import os; from openai import OpenAI; '
        f"c = OpenAI(base_url='{base}', api_key={key}); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', "
        f"'content': 'Hello!'}}]).choices[0].message.content)\"\n"
    )


def serve_api(
    args: argparse.Namespace,
    options: Any,
    engine_config: Any,
    attach: tuple[tuple[str, str], int, int] | None = None,
    sockets: list[Any] | None = None,
) -> int:
    """Run one HTTP process: with ``attach`` = (socket paths, core pid, index) it joins a core
    that ``run_multi_api`` started, on the listening ``sockets`` it was given."""
    import uvicorn

    from fulcrum.engine.async_engine import AsyncEngine
    from fulcrum.engine.core_client import CoreClient
    from fulcrum.entrypoints.openai.api_server import DrainingServer, build_app
    from fulcrum.entrypoints.openai.serving_base import ServerState

    logging.getLogger("fulcrum").setLevel(args.log_level.upper())
    state = ServerState(options)

    async def make_engine(metrics: Any) -> AsyncEngine:
        client = CoreClient.attach(*attach) if attach is not None else None
        return await AsyncEngine.from_engine_config(
            engine_config, stats_sink=metrics, client=client
        )

    app = build_app(state, make_engine)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
        lifespan="on",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )
    names = options.served_model_names
    tls = bool(args.ssl_certfile)
    banner = usage_banner(args.host, args.port, names[0], bool(options.api_key), tls)
    show_banner = attach is None or attach[2] == 0

    class _Server(DrainingServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and show_banner:
                print(banner, flush=True)

    server = _Server(config, state)
    server.run(sockets=sockets)
    if not server.started or server.engine_died:
        return 1
    return 0
