"""The HTTP front of the Ray Serve application: a FastAPI ingress that reads each request,
extracts its prompt text for the cache-aware request router, and forwards it through the
engine deployment's handle; the replica's response streams back unchanged, with the replica's
id in ``x-fulcrum-replica``. ``GET /metrics`` asks every live replica for its own and answers
their union, each sample labelled with its ``replica``.

A replica that dies before it answers (killed, or its node lost) costs the client nothing: the
request is sent again, to another replica, up to ``RETRIES`` times."""

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from fulcrum.ray import request_router
from fulcrum.ray.messages import ProxiedRequest, ResponseHead
from fulcrum.router.shape import prompt_text

logger = logging.getLogger(__name__)

RETRIES = 2
RETRY_BACKOFF_S = 0.05  # doubled after each lost attempt
METRICS_TIMEOUT_S = 10.0  # a replica's /metrics answer; a slower one is left out of the scrape
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
        headers = _headers(head)
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_rest(gen), status_code=head.status, headers=headers)
        body = b"".join([chunk async for chunk in gen])
        return Response(body, status_code=head.status, headers=headers)
    return _unavailable("No replica answered; the deployment is recovering, retry shortly.")


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus texts of several replicas as one, each sample labelled ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for rid, text in texts.items():
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for sample in fam.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": rid}))

    class _Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


async def _ask(engine: Any, req: ProxiedRequest) -> tuple[ResponseHead, bytes] | None:
    """One replica's whole answer, or None if it was lost or took longer than
    ``METRICS_TIMEOUT_S``."""
    gen = engine.forward.remote(req)

    async def read() -> tuple[ResponseHead, bytes]:
        head = await gen.__anext__()
        return head, b"".join([chunk async for chunk in gen])

    try:
        return await asyncio.wait_for(read(), METRICS_TIMEOUT_S)
    except (RayActorError, ActorUnavailableError, StopAsyncIteration, TimeoutError):
        gen.cancel()
        return None


async def all_metrics(engine: Any, req: ProxiedRequest, ids: list[str]) -> Response:
    """Every live replica's /metrics, merged; a replica that refuses (401 without the API key)
    answers for all. Falls back to one replica's when the router has not listed them yet."""
    # One at a time: asked together, the pinned requests were seen to stall in Serve's routing.
    answers = [await _ask(engine, dataclasses.replace(req, replica=r)) for r in ids]
    texts: dict[str, str] = {}
    for rid, got in zip(ids, answers, strict=True):
        if got is None or got[0].replica != rid:
            continue  # lost, or gone before it was asked (another replica answered)
        head, body = got
        if head.status != 200:
            return Response(body, status_code=head.status, headers=_headers(head))
        texts[rid] = body.decode()
    if not texts:
        return await forward(engine, req)
    headers = {"x-fulcrum-replica": ",".join(texts)}
    return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4", headers=headers)


def _headers(head: ResponseHead) -> dict[str, str]:
    headers = {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in head.headers
        if k.lower() not in _HOP_HEADERS
    }
    headers["x-fulcrum-replica"] = head.replica
    return headers


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
        ids = request_router.LIVE_REPLICAS
        if request.method == "GET" and req.path == "/metrics" and len(ids) > 1:
            return await all_metrics(self.engine, req, list(ids))
        return await forward(self.engine, req)
