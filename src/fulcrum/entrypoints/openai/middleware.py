"""One pure-ASGI layer in front of the app: drain (503), API key (401), body limit (413),
and the in-flight count that SIGTERM draining waits on."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fulcrum.entrypoints.openai.errors import OpenAIError, draining, too_large, unauthorized
from fulcrum.entrypoints.openai.serving_base import ServerState
from fulcrum.entrypoints.openai.sse import encode_json

# Answered while draining (probes and scrapes); everything else gets 503.
_ALWAYS_OPEN = frozenset({"/health", "/ready", "/metrics", "/version"})


# What an API key also guards unless --public-endpoints: scrapes and the API's own description
# tell an outsider the model, the load and every route, so they follow the key by default.
_DESCRIPTIVE = frozenset({"/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def needs_key(path: str, public_endpoints: bool = False) -> bool:
    """Whether ``path`` needs the API key (when one is set); /health, /ready, /version never do."""
    if path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        return True
    return path in _DESCRIPTIVE and not public_endpoints


async def send_error(send: Send, err: OpenAIError) -> None:
    body = encode_json(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ServerGuard:
    """Checks that need no routing, before the app sees the request."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    def _authorized(self, scope: Scope) -> bool:
        key = self.state.options.api_key
        if not key:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), key.encode()
                )
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if self.state.draining and path not in _ALWAYS_OPEN:
            await send_error(send, draining())
            return
        if needs_key(path, self.state.options.public_endpoints) and not self._authorized(scope):
            await send_error(send, unauthorized())
            return
        limit = self.state.options.max_request_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await send_error(send, too_large(limit))
                    return
        body, ok, disconnected = await _read_body(receive, limit)
        if not ok:
            await send_error(send, too_large(limit))
            return
        replay = _Replay(body, receive, disconnected)
        self.state.in_flight_http += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.in_flight_http -= 1


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool, bool]:
    """Read the whole body; (body, within limit, client disconnected)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"".join(chunks), True, True
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", False, False
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks), True, False


class _Replay:
    """``receive`` that first hands out the buffered body, then the client's messages."""

    def __init__(self, body: bytes, receive: Receive, disconnected: bool) -> None:
        self.body: bytes | None = body
        self.receive = receive
        self.disconnected = disconnected

    async def __call__(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        if self.disconnected:
            return {"type": "http.disconnect"}
        msg: dict[str, Any] = dict(await self.receive())
        return msg
