"""Tool-call formats, one parser each, behind one small interface.

``hermes``   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, and
             the prompt fulcrum writes for templates that do not render tools themselves)
``llama3_json``  ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, optionally
             after ``<|python_tag|>``
``mistral``  ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``
``granite``  ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (Granite 3)
``forced``   the JSON array ``[{"name": ..., "parameters": {...}}]`` that ``tool_choice``
             ``required`` / a named tool makes the model write (tool_prompt.tool_call_schema)

Each parser says where its calls begin (``find_start``) and what may stand between them
(``gap``); the call objects themselves are read by one incremental scanner (scanner.py), the
same for a finished text and for a stream.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC
from dataclasses import dataclass
from typing import Any

from fulcrum.entrypoints.openai.tool_parsers.scanner import CallScanner, ScannedCall


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    name: str
    start: str  # text that opens the calls: streaming holds output back from here on
    gap: re.Pattern[str]  # what may precede each call object, from ``start`` on
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def find_start(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: not (yet) a tool call)."""
        return text.find(self.start)

    def scanner(self) -> CallScanner:
        return CallScanner(self.gap, self.args_keys)

    def parse(
        self, text: str, names: frozenset[str] | None = None
    ) -> tuple[str, list[ParsedToolCall]]:
        """The content left outside the calls, and the calls (none: plain content): the leading
        run of calls that count (:meth:`counted`; ``names``: the request's tools)."""
        at = self.find_start(text)
        if at < 0:
            return text, []
        sc = self.scanner()
        sc.feed(text[at:])
        calls = []
        for c in sc.calls:
            parsed = self.counted(sc, c, names) if c.complete else None
            if parsed is None:
                break
            calls.append(parsed)
        if not calls:
            return text, []
        return self.content_before(text, at), calls

    def counted(
        self, sc: CallScanner, call: ScannedCall, names: frozenset[str] | None
    ) -> ParsedToolCall | None:
        """A complete scanned object as a call, or None where it does not count: no name, a
        name outside ``names``, or arguments that are not a JSON object (given as an object or
        as a string holding one)."""
        args = sc.streamable_arguments(call)
        if call.name is None or (names is not None and call.name not in names):
            return None
        return ParsedToolCall(call.name, args) if _is_object(args) else None

    def content_before(self, text: str, at: int) -> str:
        return text[:at].rstrip()


def _is_object(args: str) -> bool:
    try:
        return isinstance(json.loads(args), dict)
    except json.JSONDecodeError:
        return False


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    gap = re.compile(r"(?:\s*</tool_call>)?\s*<tool_call>\s*")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"
    gap = re.compile(r"[\s;]*")
    args_keys = ("parameters", "arguments")

    def find_start(self, text: str) -> int:
        # Calls only when the output is nothing but calls: a brace inside prose is content.
        at = text.find("{")
        head = text[:at].strip().removeprefix("<|python_tag|>").strip() if at >= 0 else ""
        return at if at >= 0 and not head else -1

    def content_before(self, text: str, at: int) -> str:
        return ""


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    gap = re.compile(r"(?:\[TOOL_CALLS\])?\s*[\[,]?\s*")


class GraniteParser(ToolParser):
    name = "granite"
    start = "<|tool_call|>"
    gap = re.compile(r"(?:<\|tool_call\|>)?\s*[\[,]?\s*")


class ForcedParser(ToolParser):
    name = "forced"
    start = ""
    gap = re.compile(r"\s*[\[,]\s*")
    args_keys = ("parameters",)

    def find_start(self, text: str) -> int:
        return 0


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r}; choose one of {', '.join(PARSERS)}."
        ) from None


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's tool format calls for; ``hermes`` where it names none (fulcrum
    then describes the tools in Hermes' format itself, see tool_prompt.py)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|tool_call|>" in t:
        return "granite"
    if "<|python_tag|>" in t or ("ipython" in t and "<|eot_id|>" in t):
        return "llama3_json"
    return "hermes"
