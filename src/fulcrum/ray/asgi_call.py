"""Run one HTTP request through an in-process ASGI app and stream its response back.

A replica serves fulcrum's own FastAPI app (every route, validation, limits and error shape of
``fulcrum serve``) without a socket: the request arrives as a message from the ingress, the app is
called directly, and what it sends comes back as a head followed by body chunks. Closing the
iterator early (the client went away) tells the app ``http.disconnect``, which aborts the engine
request as a dropped connection would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fulcrum.ray.messages import ProxiedRequest, ResponseHead

logger = logging.getLogger(__name__)

_END = object()


def http_scope(req: ProxiedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "query_string": req.query_string,
        "root_path": "",
        "headers": list(req.headers),
        "client": req.client,
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def call_asgi(app: Any, req: ProxiedRequest, replica: str) -> AsyncIterator[Any]:
    """Yield a :class:`ResponseHead`, then the body chunks (non-empty bytes)."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    async def run() -> None:
        try:
            await app(http_scope(req), receive, send)
        finally:
            await out.put(_END)

    task = asyncio.ensure_future(run())
    started = False
    try:
        while True:
            msg = await out.get()
            if msg is _END:
                break
            if msg["type"] == "http.response.start":
                started = True
                yield ResponseHead(msg["status"], list(msg.get("headers", [])), replica)
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
        if not started:  # the app ended without answering: surface its error, if any
            await task
            raise RuntimeError("the app sent no response")
    finally:
        gone.set()
        if not task.done():
            # Let the app see the disconnect and abort its engine request, then stop it.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            # The app already answered 500 (Starlette's error middleware) and re-raised.
            logger.warning("request %s %s failed: %r", req.method, req.path, task.exception())
