"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every failure the server reports goes through :class:`OpenAIError`; the exception handlers in
:func:`install_error_handlers` turn FastAPI's own validation errors (which would be 422) and
Starlette's HTTP errors into the same body, so a client sees one error format everywhere.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fulcrum.entrypoints.openai.messages import ROLES

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
        f"Too many queued requests: the server holds at most {limit} waiting sequences "
        "(prompts x n). Retry later.",
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


# Error types that only say "not this type", and how to name the type. With a union, each member
# that does not match adds one of these, so the error worth reporting is another one (the member
# whose type matched), or, when none matched, a list of the types that would.
_TYPE_NAMES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "none_required": "null",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
_TYPE_MISMATCH = frozenset(_TYPE_NAMES)
_SUB_FIELD = re.compile(r"^(\[\d+\]|[a-z_]\w*)(\[\d+\])*(\.[a-z_]\w*(\[\d+\])*)*: ")
_ROLES = frozenset(ROLES)


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member it tried into the location: "str", "list[int]",
    "function-after[...]", a class name, or a discriminated union's tag (a role)."""
    return (
        any(c in part for c in "[]-")
        or part in ("str", "int", "float", "bool", "none")
        or part[:1].isupper()
        or part in _ROLES
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "tool", "tool_call_id")`` -> ``messages[0].tool_call_id``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and not _is_union_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def _pick_error(errors: list[Any]) -> Any:
    """The most telling error: a matched member's complaint over type mismatches, then the
    deepest location (``prompt[0][0]`` says more than ``prompt``)."""
    telling = [e for e in errors if e.get("type") not in _TYPE_MISMATCH] or errors
    return max(telling, key=lambda e: len(e.get("loc", ())))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "Invalid request.", None
    first = _pick_error(errors)
    kind = first.get("type")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if kind == "json_invalid":
        return f"Request body is not valid JSON: {msg}.", None
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        field = str(first.get("ctx", {}).get("discriminator", "")).strip("'")
        param = f"{param}.{field}" if param and field else param
        if kind == "union_tag_not_found":
            return f"Missing required parameter: '{param}'.", param
        tags = first.get("ctx", {}).get("expected_tags", "")
        return f"Invalid value for '{param}': {first['ctx']['tag']!r} is not one of {tags}.", param
    if kind == "missing" and param:
        return f"Missing required parameter: '{param}'.", param
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        sub = _SUB_FIELD.match(msg)
        if sub is not None:  # "content[0]: ..." names a field below the error's location
            field = sub.group(0)[:-2]
            joined = field if not param else param + ("" if field[0] == "[" else ".") + field
            return f"{joined}: {msg[sub.end():]}", joined
    kinds = [e.get("type") for e in errors if _loc_to_param(tuple(e.get("loc", ()))) == param]
    if len(set(kinds)) > 1 and all(k in _TYPE_MISMATCH for k in kinds):  # no member matched
        names = dict.fromkeys(_TYPE_NAMES[k] for k in kinds)
        msg = "Input should be " + " or ".join(names)
    where = f"'{param}'" if param else "request body"
    return f"Invalid value for {where}: {msg.rstrip('.')}.", param


def _parse_error_message(exc: StarletteHTTPException) -> str | None:
    """FastAPI answers every body it cannot decode with one vague message; its cause says why."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "Request body is not valid UTF-8."
    if isinstance(cause, RecursionError):
        return "Request body is not valid JSON: nesting too deep."
    return None


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
        if status == 400:
            message = _parse_error_message(exc) or message
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
