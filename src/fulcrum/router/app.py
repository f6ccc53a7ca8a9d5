"""The router's FastAPI app: the OpenAI routes forwarded to workers, ``/v1/models`` merged over
workers, ``/health``, ``/metrics``, and ``GET/POST/DELETE /workers`` for run-time changes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fulcrum.router.config import RouterConfig
from fulcrum.router.health import health_loop
from fulcrum.router.proxy import Forwarder, error_response, upstream_headers
from fulcrum.router.state import RouterState

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def make_client(
    cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
    )


def build_app(
    cfg: RouterConfig,
    transport: httpx.AsyncBaseTransport | None = None,
    health_checks: bool = True,
) -> FastAPI:
    """``transport`` replaces the network (tests); ``health_checks`` runs the background loop."""
    state = RouterState(cfg)
    client = make_client(cfg, transport)
    forwarder = Forwarder(state, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(health_loop(state, client)) if health_checks else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await client.aclose()

    app = FastAPI(title="fulcrum router", lifespan=lifespan)
    app.state.router = state

    def unauthorized(request: Request) -> Response | None:
        if cfg.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
            return None
        return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)")

    async def proxied(request: Request, path: str) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        return await forwarder.forward(path, raw, body, request.headers)

    def forward_route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await proxied(request, path)

        return route

    # every request the workers answer; each forwarded as it came
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                 "/classify", "/v1/score", "/v1/rerank"):  # fmt: skip
        app.add_api_route(path, forward_route(path), methods=["POST"], name=path)

    async def to_every_worker(request: Request, path: str) -> Response:
        """A change every worker must make (an adapter loaded or unloaded): sent to each
        available worker at once; 200 if all answered 200, else the first failure's answer,
        naming its worker (the others keep the change)."""
        if (denied := unauthorized(request)) is not None:
            return denied
        raw = await request.body()
        workers = [w for w in state.workers() if w.available()]
        if not workers:
            return error_response(503, "no worker is available")

        async def one(w: Any) -> tuple[Any, int, bytes]:
            try:
                r = await client.post(w.url + path, content=raw,
                                      headers=upstream_headers(request.headers, w))  # fmt: skip
                return w, r.status_code, r.content
            except httpx.HTTPError as e:
                return w, 502, json.dumps({"error": {"message": f"{type(e).__name__}: {e}"}}).encode()

        results = await asyncio.gather(*(one(w) for w in workers))
        for w, status, content in results:
            if status != 200:
                try:
                    message = json.loads(content)["error"]["message"]
                    param = json.loads(content)["error"].get("param")
                except (ValueError, KeyError, TypeError):
                    message, param = content.decode(errors="replace"), None
                done = sum(1 for r in results if r[1] == 200)
                return error_response(status, f"worker {w.url}: {message} ({done} of "
                                      f"{len(results)} workers made the change)", param)  # fmt: skip
        return Response(results[0][2], 200, media_type="text/plain")

    def broadcast_route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await to_every_worker(request, path)

        return route

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        app.add_api_route(path, broadcast_route(path), methods=["POST"], name=path)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        seen: dict[str, Any] = {}
        for w in [w for w in state.workers() if w.available()]:
            try:
                r = await client.get(w.url + "/v1/models", headers=upstream_headers({}, w))
                if r.status_code == 200:
                    for m in r.json().get("data", []):
                        seen.setdefault(m.get("id"), m)
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
        if not seen and not any(w.available() for w in state.workers()):
            return error_response(503, "no worker is available")
        return JSONResponse({"object": "list", "data": list(seen.values())})

    @app.get("/health")
    async def health() -> Response:
        ok = any(w.available() for w in state.workers())
        return JSONResponse({"status": "ok" if ok else "no worker available"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def admin_denied(request: Request) -> Response | None:
        if cfg.api_key is None:
            return error_response(403, "start the router with --api-key to manage workers")
        return unauthorized(request)

    @app.get("/workers")
    async def list_workers(request: Request) -> Response:
        if (denied := unauthorized(request)) is not None:
            return denied
        return JSONResponse(state.describe())

    async def admin_body(request: Request) -> dict[str, Any] | Response:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        url = body.get("url", request.query_params.get("url"))
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return error_response(400, "url: a worker URL starting with http:// or https://", "url")
        body["url"] = url
        return body

    async def admin_request(request: Request) -> dict[str, Any] | Response:
        denied = admin_denied(request)
        return denied if denied is not None else await admin_body(request)

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        body = await admin_request(request)
        if isinstance(body, Response):
            return body
        try:
            w = state.add_worker(body["url"], body.get("pool"), body.get("api_key"))
        except ValueError as e:
            return error_response(400, str(e), str(e).split(":", 1)[0])
        return JSONResponse(w.to_dict(), 201)

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        body = await admin_request(request)
        if isinstance(body, Response):
            return body
        try:
            w = state.remove_worker(body["url"])
        except KeyError:
            return error_response(404, f"url: no worker {body['url']!r}", "url")
        return JSONResponse(w.to_dict())

    return app
