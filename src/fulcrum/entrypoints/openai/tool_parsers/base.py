"""Tool-call formats, one parser each, behind one small interface.

``hermes``   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, and
             the prompt fulcrum writes for templates that do not render tools themselves)
``llama3_json``  ``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, optionally
             after ``<|python_tag|>``
``mistral``  ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, args_key: str = "arguments") -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(obj["name"], text)


class ToolParser(ABC):
    name: str
    start: str  # text that opens a tool call: streaming holds output back from here on

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The content left outside the calls, and the calls (none: plain content)."""


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        calls = []
        for body in self._re.findall(text):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        return text[: text.find(self.start)].strip(), calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        dec, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \n;":
                i += 1
        return "", calls


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            objs = json.loads(text[at + len(self.start):].strip())
        except json.JSONDecodeError:
            return text, []
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(o) for o in objs]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].strip(), [c for c in calls if c is not None]


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
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
    if "<|python_tag|>" in t or ("ipython" in t and "<|eot_id|>" in t):
        return "llama3_json"
    return "hermes"
