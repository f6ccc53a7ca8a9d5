"""Chat templates rendered in a sandboxed Jinja environment.

The template comes from the model (its tokenizer config or GGUF metadata, exposed by the Hugging
Face tokenizer as ``chat_template``). A request may carry its own template only when the server
runs with ``--trust-request-chat-template``; templates are compiled once and cached.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError, Undefined
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDERED_CHARS = 8 * 1024 * 1024


class ChatTemplateError(ValueError):
    """The template failed to render (the message says why); reported as a 400."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"messages: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=False)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, undefined=Undefined, autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    try:
        return _ENV.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"chat_template: does not compile: {e}") from None


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Render ``messages`` with ``template`` in the sandbox; raise ChatTemplateError on failure."""
    compiled = _compile(template)
    ctx: dict[str, Any] = dict(extra or {})
    ctx.update(special_tokens or {})
    ctx["messages"] = messages
    ctx["add_generation_prompt"] = add_generation_prompt
    try:
        out = compiled.render(**ctx)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat_template: rejected by the sandbox: {e}") from None
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"messages: the chat template failed to render them: {e}") from None
    except (RecursionError, OverflowError, MemoryError) as e:
        raise ChatTemplateError(f"chat_template: render aborted: {type(e).__name__}") from None
    if len(out) > MAX_RENDERED_CHARS:
        raise ChatTemplateError("messages: the rendered prompt is too large.")
    return out


def special_tokens_of(tokenizer: Any) -> dict[str, str | None]:
    """The special-token strings templates commonly refer to."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: _as_str(getattr(tokenizer, n, None)) for n in names}


def _as_str(tok: Any) -> str | None:
    if tok is None:
        return None
    return tok if isinstance(tok, str) else str(getattr(tok, "content", tok))


__all__ = ["ChatTemplateError", "render_chat", "special_tokens_of"]
