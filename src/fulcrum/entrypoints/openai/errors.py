"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure the server reports goes through :class:`OpenAIError`; the exception handlers in
:func:`install_error_handlers` turn FastAPI's own validation errors (which would be 422) and
Starlette's HTTP errors into the same body, so a client sees one error format everywhere.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error to report to the client with an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist or you do not have access to it.",
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def unauthorized() -> OpenAIError:
    return OpenAIError(
        "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
        401,
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"Request body too large: the limit is {limit} bytes.",
        413,
        "invalid_request_error",
        None,
        "request_too_large",
    )


def too_many_requests(limit: int) -> OpenAIError:
    return OpenAIError(
        f"Too many queued requests: the server holds at most {limit} waiting requests. "
        "Retry later.",
        429,
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
    )


def draining() -> OpenAIError:
    return OpenAIError(
        "The server is shutting down and accepts no new requests.",
        503,
        "service_unavailable_error",
        None,
        "server_shutting_down",
    )


def engine_dead(message: str | None = None) -> OpenAIError:
    return OpenAIError(
        message or "The engine process has stopped.",
        503,
        "service_unavailable_error",
        None,
        "engine_unavailable",
    )


def value_error(e: ValueError) -> OpenAIError:
    """A ``ValueError`` whose message starts with the offending field name (SamplingParams style)."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    param = first if first.isidentifier() else None
    return bad_request(msg, param)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic adds the union member's type name (e.g. "str", "list[int]") to the location.
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int")]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return f"Request body is not valid JSON: {msg}.", None
    if first.get("type") == "missing" and param:
        return f"Missing required parameter: '{param}'.", param
    where = f"'{param}'" if param else "request body"
    extra = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"Invalid value for {where}: {msg}.{extra}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every error path to an OpenAI body: validation → 400, HTTP errors keep their status."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(bad_request(msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        code = "not_found" if status == 404 else phrase.lower().replace(" ", "_")
        message = str(exc.detail) if exc.detail else phrase
        if status == 404:
            message = f"{message}: no such route."
        err = OpenAIError(message, status, "invalid_request_error", None, code)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(value_error(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        err = OpenAIError(
            f"Internal server error: {type(exc).__name__}", 500, "internal_error", None, None
        )
        return error_response(err)
