"""A small OpenAI-compatible stub server for testing the benchmark client.

It streams like OpenAI (``data: {json}\\n\\n`` ... ``data: [DONE]``, with ``usage`` in a final
chunk when ``stream_options.include_usage``), counts prompt tokens by whitespace (token-id
prompts by length), answers ``max_tokens`` tokens " w0 w1 ..." after ``ttft_s`` with ``itl_s``
between tokens, and exposes fulcrum-style ``/metrics``. Modes for error tests: ``html`` (a web
page everywhere), ``no_stream`` (plain JSON even when asked to stream), ``fail_every=k`` (every k-th generation request answers HTTP 500).

Run alone: ``python tests/bench/fake_openai.py --port 8123`` (used by the cold-start test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeState:
    ttft_s: float = 0.005
    itl_s: float = 0.002
    mode: str = "ok"  # "ok" | "html" | "no_stream" (ignores "stream": true)
    fail_every: int = 0
    send_usage: bool = True
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _count_prompt(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) + 3 for m in body["messages"])
    p = body.get("prompt", "")
    return len(p) if isinstance(p, list) else len(str(p).split())


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def html_mode(request: Request, call_next):
        if state.mode == "html":
            return HTMLResponse("<html><body>Welcome to nginx!</body></html>")
        return await call_next(request)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [
            "# HELP fulcrum:kv_cache_usage_perc KV-cache usage.",
            "# TYPE fulcrum:kv_cache_usage_perc gauge",
            f'fulcrum:kv_cache_usage_perc{{model_name="{MODEL}"}} {min(state.requests, 10) / 20}',
            f'fulcrum:prefix_cache_queries_total{{model_name="{MODEL}"}} {state.prefix_queries}',
            f'fulcrum:prefix_cache_hits_total{{model_name="{MODEL}"}} {state.prefix_hits}',
            f'fulcrum:num_preemptions_total{{model_name="{MODEL}"}} 0.0',
            f'fulcrum:prompt_tokens_total{{model_name="{MODEL}"}} {state.prompt_tokens}',
            f'fulcrum:generation_tokens_total{{model_name="{MODEL}"}} {state.generation_tokens}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def generate(request: Request, kind: str):
        body = await request.json()
        state.bodies.append(body)
        state.requests += 1
        if state.fail_every and state.requests % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n_prompt = _count_prompt(body)
        n_out = int(body.get("max_tokens") or 16)
        state.prompt_tokens += n_prompt
        state.prefix_queries += n_prompt
        state.prefix_hits += n_prompt // 2
        rid = f"{kind}-{state.requests}"
        words = [f" w{i}" for i in range(n_out)]

        def chunk(text: str | None, finish: str | None = None) -> dict:
            if kind == "chat":
                choice = {"index": 0, "delta": {"content": text} if text else {}}
            else:
                choice = {"index": 0, "text": text or ""}
            choice["finish_reason"] = finish
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            return {"id": rid, "object": obj, "model": MODEL, "choices": [choice]}

        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        }
        if not body.get("stream") or state.mode == "no_stream":
            await asyncio.sleep(state.ttft_s + state.itl_s * n_out)
            state.generation_tokens += n_out
            text = "".join(words)
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": 0, "text": text}
            return {"id": rid, "choices": [{**choice, "finish_reason": "length"}], "usage": usage}

        async def stream():
            if kind == "chat":
                first = chunk(None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield f"data: {json.dumps(first)}\n\n"
            await asyncio.sleep(state.ttft_s)
            for i, w in enumerate(words):
                if i:
                    await asyncio.sleep(state.itl_s)
                state.generation_tokens += 1
                yield f"data: {json.dumps(chunk(w))}\n\n"
            yield f"data: {json.dumps(chunk(None, 'length'))}\n\n"
            opts = body.get("stream_options") or {}
            if opts.get("include_usage") and state.send_usage:
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await request.json()
        state.bodies.append(body)
        state.requests += 1
        inp = body.get("input", "")
        n = len(inp) if isinstance(inp, list) else len(str(inp).split())
        state.prompt_tokens += n
        await asyncio.sleep(state.ttft_s)
        return {"object": "list", "model": MODEL,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                "usage": {"prompt_tokens": n, "total_tokens": n}}  # fmt: skip

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """The stub in a background thread of this process."""

    def __init__(self, state: FakeState | None = None) -> None:
        self.state = state or FakeState()
        self.port = free_port()
        config = uvicorn.Config(
            make_app(self.state), host="127.0.0.1", port=self.port, log_level="error"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="OpenAI-compatible stub server for tests.")
    ap.add_argument("--port", type=int, required=True, help="Port to listen on.")
    ap.add_argument(
        "--startup-delay", type=float, default=0.0, help="Seconds to wait before serving."
    )
    a = ap.parse_args()
    time.sleep(a.startup_delay)
    uvicorn.run(make_app(FakeState()), host="127.0.0.1", port=a.port, log_level="error")
