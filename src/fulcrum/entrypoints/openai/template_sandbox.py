"""The Jinja sandbox chat templates render in, with limits on what one render may build.

jinja2's ImmutableSandboxedEnvironment (as transformers uses) blocks attribute escapes and
mutation, but a template can still ask for ``'x' * 10**9``, ``2 ** 10**8``, ``'%999999999s' % 1``,
``'x'.center(10**9)`` or a doubling loop: one expression that takes seconds and gigabytes. Here
every operator and call that can make a large value is checked *before* it runs, and what each
one builds is charged to a per-render budget (``RenderBudget``), so a render can allocate at most
a few times the largest prompt it may produce. Time is bounded by the caller (chat_template.py).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable, Sized
from datetime import datetime
from typing import Any

from jinja2 import Undefined
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDERED_CHARS = 8 * 1024 * 1024  # the longest prompt text a template may produce
MAX_REPEAT = 100_000  # longest result of ``seq * n`` (templates use it for indents and rules)
MAX_POW_BITS = 4096  # largest integer ``a ** b`` may produce
MAX_WIDTH = 100_000  # width/count arguments of padding methods and filters
BUDGET_CHARS = 8 * MAX_RENDERED_CHARS  # everything intercepted operations may build, per render

_BIG_NUMBER = re.compile(r"\d{6,}")  # a width or precision of 100,000+ in a format spec
_SIZED_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_SIZED_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})


class ChatTemplateError(ValueError):
    """The template failed to render (the message says why); reported as a 400."""


class RenderBudget(threading.local):
    """Characters (or items) the current thread's render may still build."""

    left: int = BUDGET_CHARS

    def reset(self) -> None:
        self.left = BUDGET_CHARS

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise SecurityError("the template builds too much data.")


BUDGET = RenderBudget()


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _check_format(fmt: Any, marker: str, values: Any) -> None:
    """``fmt % values`` or ``fmt.format(*values)``: no huge widths, and no result longer than the
    longest prompt (each placeholder may repeat every value)."""
    if not isinstance(fmt, str):
        return
    if _BIG_NUMBER.search(fmt):
        raise SecurityError("format width or precision too large.")
    items = values if isinstance(values, (list, tuple)) else [values]
    if isinstance(values, dict):
        items = list(values.values())
    longest = max((len(str(v)) for v in items), default=0)
    if len(fmt) + fmt.count(marker) * longest > MAX_RENDERED_CHARS:
        raise SecurityError("format result too large.")


def _check_binop(op: str, left: Any, right: Any) -> int:
    """Raise SecurityError for a result too large to build; else the result's expected size."""
    if op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
            size = len(seq) * max(n, 0)
            if size > MAX_REPEAT:
                raise SecurityError(f"repetition result too large ({size:,} > {MAX_REPEAT:,}).")
            return size
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left), 2).bit_length() * right > MAX_POW_BITS:
                raise SecurityError("power result too large.")
    elif op == "+":
        size = _size(left) + _size(right)
        if size > MAX_RENDERED_CHARS:
            raise SecurityError("concatenation result too large.")
        return size
    elif op == "%":
        _check_format(left, "%", right)
    return 0


def _check_width_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_WIDTH:
            raise SecurityError(f"{name}: argument {v:,} too large (at most {MAX_WIDTH:,}).")


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    name = getattr(obj, "__name__", "")
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in _SIZED_METHODS:
        _check_width_args(name, args, kwargs)
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            grow = (len(owner) + 1 if not old else owner.count(old)) * max(len(new) - len(old), 0)
            BUDGET.charge(len(owner) + grow)


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in filter whose numeric arguments (widths, counts) are bounded."""

    at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # where the value sits

    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if name == "join" and len(args) > at:  # charge the pieces before they are joined
            args = (*args[:at], _charged_list(args[at]), *args[at + 1 :])
        if name in _SIZED_FILTERS:
            _check_width_args(name, args[at + 1 :], kwargs)
        if name == "format" and args:  # the value is the format string
            _check_format(args[0], "%", [*args[1:], *kwargs.values()])
        out = f(*args, **kwargs)
        BUDGET.charge(_size(out))
        return out

    return wrapper


def _charged_list(items: Any) -> Any:
    if isinstance(items, (str, bytes, dict)) or not hasattr(items, "__iter__"):
        return items
    out = []
    for x in items:
        BUDGET.charge(len(x) if isinstance(x, str) else 1)
        out.append(x)
    return out


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with size checks on every operator and call that can allocate."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also stops compile-time folding

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {n: _bounded_filter(n, f) for n, f in self.filters.items()}
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        BUDGET.charge(_check_binop(operator_, left, right))
        return self.binop_table[operator_](left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format``/``format_map`` as the sandbox wraps them (at attribute access), with
        the result's size checked before formatting."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, name = value.__self__, value.__name__

        def checked(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            if name == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            _check_format(fmt, "{", values)
            out = wrapped(*args, **kwargs)
            BUDGET.charge(len(out))
            return out

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_call(__obj, args, kwargs)
        if getattr(__obj, "__name__", "") == "join" and isinstance(
            getattr(__obj, "__self__", None), str
        ):
            args = tuple(_charged_list(a) for a in args)  # charge the pieces before joining
        out = super().call(__context, __obj, *args, **kwargs)
        if isinstance(out, Sized) and not isinstance(out, range):
            BUDGET.charge(len(out))
        return out


def _bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_WIDTH:
        raise SecurityError(f"range too large ({len(rng):,} > {MAX_WIDTH:,} items).")
    return rng


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"messages: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=False)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_env() -> BoundedSandbox:
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, undefined=Undefined, autoescape=False
    )
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env

