"""The HTTP front of the Ray Serve application: a FastAPI ingress that reads each request,
extracts its prompt text for the cache-aware request router, and forwards it through the
engine deployment's handle; the replica's response streams back unchanged, with the replica's
id in ``x-fulcrum-replica``.

A replica that dies before it answers (killed, or its node lost) costs the client nothing: the
request is sent again, to another replica, up to ``RETRIES`` times."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from fulcrum.ray.messages import ProxiedRequest
from fulcrum.router.shape import prompt_text

logger = logging.getLogger(__name__)

RETRIES = 2
RETRY_BACKOFF_S = 0.05  # doubled after each lost attempt
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"host"}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

app = FastAPI(title="fulcrum on Ray Serve", openapi_url=None, docs_url=None, redoc_url=None)


def route_text(method: str, body: bytes) -> str:
    if method != "POST" or not body:
        return ""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    return prompt_text(parsed) if isinstance(parsed, dict) else ""


def _unavailable(message: str) -> JSONResponse:
    err = {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}
    return JSONResponse({"error": err}, status_code=503)


async def _rest(gen: Any) -> AsyncIterator[bytes]:
    """The body after the head; closing it early (client gone) cancels the replica's call,
    which aborts the engine request."""
    try:
        async for chunk in gen:
            yield chunk
    except (RayActorError, ActorUnavailableError) as e:
        # Mid-stream loss: end the stream with an error event rather than a cut connection.
        logger.warning("replica lost mid-stream: %r", e)
        err = {"message": "The replica serving this request was lost.", "type": "server_error"}
        yield f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()
    finally:
        gen.cancel()


async def forward(engine: Any, req: ProxiedRequest) -> Response:
    """Send ``req`` through the engine deployment's streaming handle; a replica lost before
    its response head is retried on another (Serve drops the dead one from routing)."""
    for attempt in range(RETRIES + 1):
        if attempt:
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
        gen = engine.forward.remote(req)
        try:
            head = await gen.__anext__()
        except (RayActorError, ActorUnavailableError) as e:
            logger.warning("replica lost before answering (attempt %d): %r", attempt + 1, e)
            continue
        except StopAsyncIteration:
            return _unavailable("The replica ended the request without a response.")
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in head.headers
            if k.lower() not in _HOP_HEADERS
        }
        headers["x-fulcrum-replica"] = head.replica
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_rest(gen), status_code=head.status, headers=headers)
        body = b"".join([chunk async for chunk in gen])
        return Response(body, status_code=head.status, headers=headers)
    return _unavailable("No replica answered; the deployment is recovering, retry shortly.")


@serve.ingress(app)
class Ingress:
    def __init__(self, engine: Any) -> None:
        self.engine = engine.options(stream=True)

    @app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def proxy(self, path: str, request: Request) -> Response:
        body = await request.body()
        client = request.client
        req = ProxiedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=[(k, v) for k, v in request.scope["headers"] if k not in _HOP_HEADERS],
            body=body,
            client=(client.host, client.port) if client else None,
            route_text=route_text(request.method, body),
        )
        return await forward(self.engine, req)
