"""One engine replica: fulcrum's own OpenAI app and its engine, in a Ray Serve replica actor.

The replica builds the same FastAPI app as ``fulcrum serve`` (so every route, check, limit and
error is the server's) and runs its lifespan, which starts the engine core process. Requests
arrive from the ingress as :class:`ProxiedRequest` messages and go through the app in process."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.entrypoints.openai.serving_base import ServeOptions
from fulcrum.ray.asgi_call import call_asgi
from fulcrum.ray.messages import ProxiedRequest

logger = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(self, engine_args: EngineArgs, options: ServeOptions) -> None:
        from ray import serve

        from fulcrum.engine.async_engine import AsyncEngine
        from fulcrum.entrypoints.openai.api_server import build_app
        from fulcrum.entrypoints.openai.serving_base import ServerState

        # Resolved here, on the replica's node: its device (Ray sets CUDA_VISIBLE_DEVICES to the
        # replica's GPUs, or to none) and its copy of the weights.
        engine_config = engine_args.create_engine_config()

        async def make_engine(metrics: Any) -> AsyncEngine:
            return await AsyncEngine.from_engine_config(engine_config, stats_sink=metrics)

        self.state = ServerState(options)
        self.app = build_app(self.state, make_engine)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, req: ProxiedRequest) -> AsyncIterator[Any]:
        """A ResponseHead, then the body chunks (a streaming method of the deployment)."""
        async for item in call_asgi(self.app, req, self.replica_id):
            yield item

    async def check_health(self) -> None:
        """Serve's periodic probe: a dead engine core fails it, and Serve replaces the replica."""
        engine = self.state.engine
        if engine is None or engine.dead is not None:
            raise RuntimeError(f"engine is dead: {None if engine is None else engine.dead}")

    async def __del__(self) -> None:
        # Serve's graceful shutdown: stop the engine core process with the app's lifespan.
        with contextlib.suppress(Exception):
            await self._lifespan.aclose()
