"""Forward one OpenAI request to a worker: retries before the first byte, streaming pass-through,
and an SSE error event when a stream breaks midway.

    attempt 1 ──connect error / 5xx / broken before the first body byte──► backoff, next worker
    attempt 2 ──200, first chunk read──► the client gets the status, headers, first chunk, rest
                                         (a later break: 'data: {"error": ...}' then [DONE])

Nothing reaches the client before a first body byte has arrived, so every failure up to there is
retried (``max_retries`` more workers, ``retry_backoff_s`` doubled each time)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fulcrum.router.state import NoWorkerError, Pool, RouterState
from fulcrum.router.worker import Worker

log = logging.getLogger("fulcrum.router")

WORKER_HEADER = "x-fulcrum-worker"
# Hop-by-hop headers and those the router sets itself.
_DROP_REQUEST = {
    "host",
    "content-length",
    "authorization",
    "connection",
    "transfer-encoding",
    "accept-encoding",
}
_DROP_RESPONSE = {
    "content-length",
    "connection",
    "transfer-encoding",
    "content-encoding",
    "keep-alive",
}


_ERROR_TYPES = {401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(
        status, "BadRequestError" if status < 500 else "ServiceUnavailableError"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


def upstream_headers(headers: Mapping[str, str], worker: Worker) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _DROP_REQUEST}
    if worker.api_key:
        out["authorization"] = f"Bearer {worker.api_key}"
    return out


def _response_headers(resp: httpx.Response, worker: Worker) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
    out[WORKER_HEADER] = worker.url
    return out


def _sse_error(message: str) -> bytes:
    err = {"error": {"message": message, "type": "UpstreamError", "param": None, "code": 502}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


class Forwarder:
    def __init__(self, state: RouterState, client: httpx.AsyncClient) -> None:
        self.state = state
        self.client = client

    def _fail(self, w: Worker, pool: Pool, why: str) -> None:
        w.breaker.record_failure()
        self.state.metrics.errors.labels(w.url, pool.name).inc()
        log.warning("worker %s failed: %s", w.url, why)

    async def forward(
        self, path: str, raw: bytes, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Response:
        state, cfg = self.state, self.state.cfg
        pool, text = state.pool_for(body, headers)
        stream = bool(body.get("stream"))
        t0 = time.monotonic()
        tried: set[Worker] = set()
        last: tuple[int, bytes, dict[str, str]] | None = None
        why = "no attempt made"
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                state.metrics.retries.labels(pool.name).inc()
                await asyncio.sleep(cfg.retry_backoff_s * 2 ** (attempt - 1))
            try:
                w = state.choose(pool, text, tried).worker
            except NoWorkerError as e:
                why = str(e)
                break
            tried.add(w)
            w.breaker.on_dispatch()
            w.in_flight += 1
            try:
                req = self.client.build_request(
                    "POST", w.url + path, content=raw, headers=upstream_headers(headers, w)
                )
                resp = await self.client.send(req, stream=True)
                if resp.status_code >= 500:
                    last = (resp.status_code, await resp.aread(), _response_headers(resp, w))
                    await resp.aclose()
                    self._fail(w, pool, f"HTTP {resp.status_code}")
                    why = f"worker {w.url} answered {resp.status_code}"
                    continue
                chunks = resp.aiter_bytes()
                if not (stream and resp.status_code == 200):
                    content = await resp.aread()
                    await resp.aclose()
                    return self._finish(w, pool, resp, content, t0)
                first = await anext(chunks, b"")
            except httpx.HTTPError as e:
                self._fail(w, pool, repr(e))
                why = f"worker {w.url}: {type(e).__name__}"
                continue
            finally:
                w.in_flight -= 1
            w.breaker.record_success()
            state.metrics.ttfb.labels(w.url, pool.name).observe(time.monotonic() - t0)
            w.in_flight += 1  # held by the stream until it ends
            return StreamingResponse(
                self._relay(w, pool, resp, first, chunks, t0),
                status_code=resp.status_code,
                headers=_response_headers(resp, w),
            )
        if last is not None:
            status, content, hdrs = last
            self.state.metrics.requests.labels(hdrs[WORKER_HEADER], pool.name, str(status)).inc()
            return Response(content, status, headers=hdrs)
        return error_response(
            503 if not tried else 502, f"no worker could serve the request ({why})"
        )

    def _finish(
        self, w: Worker, pool: Pool, resp: httpx.Response, content: bytes, t0: float
    ) -> Response:
        w.breaker.record_success()
        m = self.state.metrics
        elapsed = time.monotonic() - t0
        m.ttfb.labels(w.url, pool.name).observe(elapsed)
        m.latency.labels(w.url, pool.name).observe(elapsed)
        m.requests.labels(w.url, pool.name, str(resp.status_code)).inc()
        return Response(content, resp.status_code, headers=_response_headers(resp, w))

    async def _relay(
        self,
        w: Worker,
        pool: Pool,
        resp: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        t0: float,
    ) -> AsyncIterator[bytes]:
        """Pass the stream through; a client disconnect cancels this generator, and closing the
        upstream response closes its connection, which aborts the request on the worker."""
        m = self.state.metrics
        status = str(resp.status_code)
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:
            self._fail(w, pool, f"mid-stream: {e!r}")
            status = "stream_error"
            yield _sse_error(f"worker {w.url} failed mid-stream: {type(e).__name__}")
        finally:
            w.in_flight -= 1
            await resp.aclose()
            m.latency.labels(w.url, pool.name).observe(time.monotonic() - t0)
            m.requests.labels(w.url, pool.name, status).inc()
