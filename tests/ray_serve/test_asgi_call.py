"""An ASGI app called in process, as a replica calls fulcrum's app: head and body come back,
streams chunk by chunk, and closing the stream early reaches the app as a disconnect."""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from fulcrum.ray.asgi_call import call_asgi
from fulcrum.ray.messages import ProxiedRequest, ResponseHead

closed: list[str] = []


async def echo(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"got": body, "q": request.query_params.get("x")}, status_code=201)


async def stream(request: Request) -> StreamingResponse:
    async def gen():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append("stream")

    return StreamingResponse(gen(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])


def test_json_round_trip() -> None:
    async def go() -> list[object]:
        req = ProxiedRequest(
            "POST",
            "/echo",
            query_string=b"x=7",
            headers=[(b"content-type", b"application/json")],
            body=b'{"a": 1}',
        )
        return [item async for item in call_asgi(APP, req, "r1")]

    head, *chunks = asyncio.run(go())
    assert isinstance(head, ResponseHead) and head.status == 201 and head.replica == "r1"
    assert (b"content-type", b"application/json") in head.headers
    assert json.loads(b"".join(chunks)) == {"got": {"a": 1}, "q": "7"}


def test_closing_early_disconnects_the_app() -> None:
    async def go() -> list[object]:
        items = []
        it = call_asgi(APP, ProxiedRequest("GET", "/stream"), "r1")
        async for item in it:
            items.append(item)
            if len(items) == 3:
                break
        await it.aclose()
        return items

    closed.clear()
    head, first, second = asyncio.run(go())
    assert head.status == 200 and first == b"data: 0\n\n" and second == b"data: 1\n\n"
    assert closed == ["stream"]  # the app's stream ended instead of running 1000 steps
