"""The client times every chunk that carries token ids, even when its text is empty."""

from __future__ import annotations

import asyncio
import json

import httpx

from fulcrum.bench.client import Endpoint, send_request


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _run(chunks: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, Endpoint("http://x", "m"), "chat", {"messages": []}, 3)

    return asyncio.run(go())


def test_empty_text_chunks_with_token_ids_are_timed() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    steps = [
        {"choices": [{"index": 0, "delta": {"content": t}, "token_ids": [i]}]}
        for i, t in enumerate(["", "a", "", "b"])
    ]
    usage = {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 3}}
    res = _run([role, *steps, usage])
    assert res.success and res.output_len == 4
    assert len(res.itl) == 3  # four timed chunks, though two have no text
    assert res.generated_text == "ab"
    # Without token ids only text chunks are timed (the OpenAI API's own stream).
    plain = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in ["", "a", "", "b"]]
    res = _run([role, *plain, usage])
    assert res.success and len(res.itl) == 1
