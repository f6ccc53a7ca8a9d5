"""What the OpenAPI schema says beyond the routes' models: the probes' bodies, the Prometheus
text of /metrics, and no 422 (validation errors are answered 400 with an OpenAI error body)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from fulcrum.entrypoints.openai.metrics import CONTENT_TYPE

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


def install(app: FastAPI) -> None:
    """Build the schema once, as FastAPI does, without the 422 responses it adds to each route."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _strip_422(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
