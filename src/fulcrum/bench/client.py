"""Streaming OpenAI-compatible client: one request in, timings and token counts out.

Works unchanged against fulcrum, vLLM and SGLang. Timing follows vLLM's benchmark:
TTFT is the time to the first chunk carrying text, ITL the gaps between later text chunks,
latency the time to the end of the stream. A chunk that carries token ids (vLLM's
``return_token_ids``, asked for with ``--extra-body '{"return_token_ids": true}'``) counts even
when its text is empty, so tokens without visible text (special tokens, half a UTF-8 character)
are timed one by one. The output length is the server's
``usage.completion_tokens`` (asked for with ``stream_options.include_usage``); without it the
text is tokenized locally, or, lacking a tokenizer, text chunks are counted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class ServerError(ValueError):
    """The server is unreachable or does not speak the OpenAI API (one line for users)."""


@dataclass
class Endpoint:
    base_url: str  # without the trailing /v1
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def url(self, kind: str) -> str:
        path = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                "embeddings": "/v1/embeddings"}[kind]  # fmt: skip
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one request measured; ``success`` False keeps the error and is never dropped."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter at send
    generated_text: str = ""
    usage_reported: bool = False
    session_id: int = 0
    turn: int = 0


def normalise_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"base URL must start with http:// or https://, got {url!r}.")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _delta_text(kind: str, choice: dict[str, Any]) -> str:
    if kind == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _error_line(status: int, body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        msg = str(msg or body)
    except (json.JSONDecodeError, AttributeError):
        msg = body
    msg = " ".join(msg.split())[:200]
    return f"HTTP {status}: {msg}" if msg else f"HTTP {status}"


def _transport_error(e: httpx.HTTPError, ep: Endpoint) -> str:
    if isinstance(e, httpx.TimeoutException):
        return f"timed out after {ep.timeout_s:g} s"
    return f"{type(e).__name__}: {str(e) or 'connection failed'}"


async def send_request(
    client: httpx.AsyncClient,
    ep: Endpoint,
    kind: str,
    payload: dict[str, Any],
    prompt_len: int,
    tokenizer: Any | None = None,
) -> RequestResult:
    """POST ``payload`` with streaming on; never raises for request-level failures."""
    if kind == "embeddings":
        return await _embed_request(client, ep, payload, prompt_len)
    body = {**payload, "model": ep.model, "stream": True}
    body["stream_options"] = {"include_usage": True}
    res = RequestResult(prompt_len=prompt_len)
    st = res.start_time = time.perf_counter()
    last = st
    chunks: list[str] = []
    saw_openai_chunk = False
    try:
        async with client.stream(
            "POST", ep.url(kind), json=body, headers=ep.headers(), timeout=ep.timeout_s
        ) as resp:
            if resp.status_code != 200:
                res.error = _error_line(
                    resp.status_code, (await resp.aread()).decode(errors="replace")
                )
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    res.error = f"not an OpenAI stream: unexpected line {line[:80]!r}"
                    return res
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    res.error = f"not an OpenAI stream: invalid JSON chunk {data[:80]!r}"
                    return res
                if not isinstance(chunk, dict):
                    res.error = "not an OpenAI stream: chunk is not an object"
                    return res
                if "error" in chunk:
                    res.error = f"server error in stream: {str(chunk['error'])[:200]}"
                    return res
                now = time.perf_counter()
                choices = chunk.get("choices")
                if isinstance(choices, list):
                    saw_openai_chunk = True
                    parts = [c for c in choices if isinstance(c, dict)]
                    text = "".join(_delta_text(kind, c) for c in parts)
                    if text or any(c.get("token_ids") for c in parts):
                        if not chunks:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks.append(text)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    saw_openai_chunk = True
                    res.usage_reported = True
                    res.output_len = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.prompt_len = int(usage["prompt_tokens"])
        res.latency = time.perf_counter() - st
    except httpx.HTTPError as e:
        res.error = _transport_error(e, ep)
        return res
    if not saw_openai_chunk:
        res.error = "not an OpenAI stream: no chunk with 'choices'"
        return res
    res.generated_text = "".join(chunks)
    if not res.usage_reported:
        if tokenizer is not None:
            res.output_len = len(tokenizer.encode(res.generated_text, add_special_tokens=False))
        else:
            res.output_len = len(chunks)
    if res.output_len > 0 and not chunks:
        res.ttft = res.latency  # tokens without text (e.g. only special tokens)
    res.success = True
    return res


async def _embed_request(
    client: httpx.AsyncClient, ep: Endpoint, payload: dict[str, Any], prompt_len: int
) -> RequestResult:
    """One embeddings request (no stream): its latency stands for TTFT, nothing is generated."""
    res = RequestResult(prompt_len=prompt_len)
    st = res.start_time = time.perf_counter()
    try:
        resp = await client.post(ep.url("embeddings"), json={**payload, "model": ep.model},
                                 headers=ep.headers(), timeout=ep.timeout_s)  # fmt: skip
    except httpx.HTTPError as e:
        res.error = _transport_error(e, ep)
        return res
    res.latency = res.ttft = time.perf_counter() - st
    if resp.status_code != 200:
        res.error = _error_line(resp.status_code, resp.text)
        return res
    try:
        body = resp.json()
        assert isinstance(body["data"], list) and body["data"]
    except (ValueError, KeyError, TypeError, AssertionError):
        res.error = "not an OpenAI embeddings response (no 'data' list)"
        return res
    usage = body.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        res.prompt_len = int(usage["prompt_tokens"])
    res.success = True
    return res


async def list_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[str]:
    """GET /v1/models; raise ``ServerError`` unless it is an OpenAI model list."""
    url = base_url + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {base_url}: {type(e).__name__} {e}".strip()) from None
    if resp.status_code != 200:
        raise ServerError(
            f"{url} is not an OpenAI-compatible endpoint ({_error_line(resp.status_code, resp.text)})."
        )
    try:
        data = resp.json()["data"]
        return [str(m["id"]) for m in data]
    except (ValueError, KeyError, TypeError):
        raise ServerError(
            f"{url} is not an OpenAI-compatible endpoint (no model list in the response)."
        ) from None
