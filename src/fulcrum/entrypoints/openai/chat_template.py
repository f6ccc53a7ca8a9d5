"""Chat templates rendered in a bounded sandbox, off the event loop.

The template comes from the model (its tokenizer config or GGUF metadata, exposed by the Hugging
Face tokenizer as ``chat_template``). A request may carry its own template only when the server
runs with ``--trust-request-chat-template``. Either way a render is bounded three ways:
what it may build (template_sandbox.py), how long its output may be (MAX_RENDERED_CHARS), and
how long it may run (``timeout``): ``render_chat_async`` compiles and renders in a thread of its
own, so /health and every stream keep being served meanwhile, and a render past its time is
stopped by an exception raised inside that thread (a Python thread cannot be killed, but pure
Python code such as a compiled template can be interrupted that way). Compiled templates are
cached by total source size, so many distinct templates cannot pile up in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
import time
from collections import OrderedDict
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.exceptions import SecurityError

from fulcrum.entrypoints.openai.template_sandbox import (
    BUDGET,
    MAX_RENDERED_CHARS,
    ChatTemplateError,
    make_env,
)

RENDER_TIMEOUT_S = 5.0  # model templates render in milliseconds; this only stops runaway ones
CACHE_CHARS = 2 * 1024 * 1024  # total source size of the compiled templates kept


class RenderTimeout(Exception):
    """Raised inside a render thread that ran past its time."""


_ENV = make_env()


class _TemplateCache:
    """LRU of compiled templates, bounded by the total length of their sources."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self.items: OrderedDict[str, Template] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, source: str) -> Template:
        with self.lock:
            hit = self.items.get(source)
            if hit is not None:
                self.items.move_to_end(source)
                return hit
        try:
            compiled = _ENV.from_string(source)
        except SecurityError as e:  # constant folding is off for the bounded operators, but
            raise ChatTemplateError(f"chat_template: rejected by the sandbox: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"chat_template: does not compile: {e}") from None
        if len(source) <= self.max_chars:
            with self.lock:
                if source not in self.items:
                    self.items[source] = compiled
                    self.chars += len(source)
                while self.chars > self.max_chars:
                    old, _ = self.items.popitem(last=False)
                    self.chars -= len(old)
        return compiled


_CACHE = _TemplateCache(CACHE_CHARS)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    extra: dict[str, Any] | None = None,
    timeout: float = RENDER_TIMEOUT_S,
) -> str:
    """Render ``messages`` with ``template`` in the sandbox, in the calling thread; raise
    ChatTemplateError on failure. The output's length and the time between output pieces are
    checked as it is produced; ``render_chat_async`` also stops a render that produces nothing."""
    deadline = time.monotonic() + timeout
    BUDGET.reset()
    ctx: dict[str, Any] = dict(extra or {})
    ctx.update(special_tokens or {})
    ctx["messages"] = messages
    ctx["add_generation_prompt"] = add_generation_prompt
    try:
        compiled = _CACHE.get(template)
        parts: list[str] = []
        size = 0
        for part in compiled.generate(**ctx):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise ChatTemplateError(
                    "messages: the rendered prompt is longer than "
                    f"{MAX_RENDERED_CHARS:,} characters."
                )
            if time.monotonic() > deadline:
                raise RenderTimeout
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except RenderTimeout:
        raise _timed_out(timeout) from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat_template: rejected by the sandbox: {e}") from None
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"messages: the chat template failed to render them: {e}") from None
    except (RecursionError, OverflowError, MemoryError) as e:
        raise ChatTemplateError(f"chat_template: render aborted: {type(e).__name__}") from None


async def render_chat_async(
    template: str,
    messages: list[dict[str, Any]],
    *,
    timeout: float = RENDER_TIMEOUT_S,
    **kwargs: Any,
) -> str:
    """``render_chat`` in a thread of its own, awaited for at most ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str] = loop.create_future()
    lock = threading.Lock()
    finished = False

    def settle(result: str | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result or "")

    def work() -> None:
        nonlocal finished
        result: str | None = None
        error: BaseException | None = None
        try:
            result = render_chat(template, messages, timeout=timeout, **kwargs)
        except BaseException as e:  # handed to the awaiting coroutine
            error = e
        finally:
            with lock:
                finished = True
        if isinstance(error, RenderTimeout):
            error = _timed_out(timeout)
        with contextlib.suppress(RuntimeError):  # the loop may be gone after a timeout
            loop.call_soon_threadsafe(settle, result, error)

    thread = threading.Thread(target=work, name="chat-template", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        with lock:
            if not finished and thread.ident is not None:
                _interrupt(thread.ident)
        raise _timed_out(timeout) from None


def _timed_out(timeout: float) -> ChatTemplateError:
    return ChatTemplateError(f"chat_template: rendering took longer than {timeout:g} s.")


def _interrupt(thread_id: int) -> None:
    """Raise RenderTimeout in the thread at its next bytecode boundary."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(RenderTimeout)
    )


def special_tokens_of(tokenizer: Any) -> dict[str, str | None]:
    """The special-token strings templates commonly refer to."""
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: _as_str(getattr(tokenizer, n, None)) for n in names}


def _as_str(tok: Any) -> str | None:
    if tok is None:
        return None
    return tok if isinstance(tok, str) else str(getattr(tok, "content", tok))


__all__ = [
    "ChatTemplateError",
    "render_chat",
    "render_chat_async",
    "special_tokens_of",
]
