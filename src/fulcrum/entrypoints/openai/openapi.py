"""What the OpenAPI schema says beyond the routes' models: the probes' bodies, the Prometheus
text of /metrics, streamed responses, this server's limits (--max-n, --max-logprobs,
--max-tokens-limit, the context length, the vocabulary) and no 422 (validation errors are answered
400 with an OpenAI error body)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI

from fulcrum.entrypoints.openai.metrics import CONTENT_TYPE
from fulcrum.entrypoints.openai.protocol import TOKEN_ID_DESCRIPTION
from fulcrum.entrypoints.openai.serving_base import ServerState

_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_DEAD = {"description": "The engine process has stopped.", "content": _ERROR}

# With "stream": true. Before OpenAPI 3.2's itemSchema, a text/event-stream schema describes one
# event, which a client reads as {"data": ...}.
SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {
                "data": {
                    "type": "string",
                    "description": "One chunk as JSON (the response object with deltas), an "
                    '{"error": ...} object, or [DONE] last.',
                }
            },
            "required": ["data"],
        }
    }
}

HEALTH: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine process is alive (also while draining); empty body."},
    503: _DEAD,
}
READY: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The model is loaded and the server accepts requests.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "status": {"type": "string", "enum": ["ready"]},
                        "model": {"type": "string"},
                    },
                    "required": ["status", "model"],
                }
            }
        },
    },
    503: {"description": "Draining, or the engine process has stopped.", "content": _ERROR},
}
METRICS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
    },
}
# /v1/load_lora_adapter and /v1/unload_lora_adapter: a line of text when done, as vLLM answers.
LORA_UPDATE: dict[int | str, dict[str, Any]] = {
    200: {"description": "Done; one line of text.", "content": {"text/plain": {"schema": {"type": "string"}}}},
    **{code: {"description": what, "content": _ERROR} for code, what in (
        (400, "A bad argument (the error's param names it), or runtime updates are off."),
        (401, "No or a wrong API key."),
        (404, "No adapter of that name is loaded (unload)."),
        (503, "The engine process has stopped."),
    )},
}  # fmt: skip
VERSION: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The server's version.",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"version": {"type": "string"}},
                    "required": ["version"],
                }
            }
        },
    },
}


def _strip_422(schema: dict[str, Any]) -> dict[str, Any]:
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def _set_integer_max(prop: dict[str, Any], maximum: int) -> None:
    """Lower an integer property's ``maximum`` (also inside ``anyOf`` for an optional one)."""
    for node in [prop, *prop.get("anyOf", [])]:
        if node.get("type") == "integer":
            node["maximum"] = min(maximum, node.get("maximum", maximum))


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _server_limits(schema: dict[str, Any], state: ServerState) -> dict[str, Any]:
    """This server's flags and model in the bounds, so the schema says what it will accept."""
    opts = state.options
    engine = state.engine
    components = schema.get("components", {}).get("schemas", {})
    max_tokens = opts.max_tokens_limit
    if engine is not None:
        room = engine.max_model_len - 1  # a prompt holds at least one token
        max_tokens = room if max_tokens is None else min(max_tokens, room)
    for name, logprobs in (
        ("ChatCompletionRequest", "top_logprobs"),
        ("CompletionRequest", "logprobs"),
    ):
        props = components.get(name, {}).get("properties", {})
        if "n" in props:
            _set_integer_max(props["n"], opts.max_n)
        if logprobs in props:
            _set_integer_max(props[logprobs], opts.max_logprobs)
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props and max_tokens is not None:
                _set_integer_max(props[key], max_tokens)
    if engine is not None:
        for node in _walk(components):
            if node.get("description") == TOKEN_ID_DESCRIPTION:
                node["maximum"] = engine.vocab_size - 1
    return schema


def install(app: FastAPI, state: ServerState) -> None:
    """Build the schema once, as FastAPI does, without the 422 responses it adds to each route
    and with this server's limits. It is built on first request, once the engine is up."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _server_limits(_strip_422(build()), state)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
