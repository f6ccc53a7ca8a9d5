"""A chat request's tools on the way out: which calls the output holds, whole or streamed.

``forced`` (``tool_choice`` ``required`` or named): structured output made the text a JSON array
of ``{"name", "parameters"}``, so it always parses. ``auto``: the tool parser decides; streaming
passes content through until the parser's opening text appears, then holds the rest back and
sends the calls at the end as OpenAI's deltas (id, type and name first, then the arguments)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fulcrum.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser


@dataclass
class ToolCalls:
    parser: ToolParser | None  # None: forced
    forced: bool = False

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.forced:
            try:
                objs = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut by max_tokens: no call to report
            return None, [
                ParsedToolCall(o["name"], json.dumps(o["parameters"], ensure_ascii=False))
                for o in objs
            ]
        assert self.parser is not None
        content, calls = self.parser.parse(text)
        return (content or None) if calls else content, calls

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The choice's message, and whether it holds tool calls."""
        content, calls = self.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
        return msg, bool(calls)


@dataclass
class ToolStream:
    """One choice's streamed text: what may be sent as content now, and the calls at the end."""

    tools: ToolCalls
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    held: bool = False  # the opening text appeared: the rest waits for the end
    calls: list[ParsedToolCall] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.tools.forced or self.held:
            return ""
        start = self.tools.parser.start if self.tools.parser else ""
        at = self.text.find(start, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = self.text[self.sent:at], at
            return out
        # Keep back a tail that may be the beginning of the opening text.
        keep = next((k for k in range(min(len(start) - 1, len(self.text)), 0, -1)
                     if start.startswith(self.text[-k:])), 0)
        out, self.sent = self.text[self.sent: len(self.text) - keep], len(self.text) - keep
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Content still to send, and the tool-call deltas (empty: no calls)."""
        content, calls = self.tools.parse(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        self.calls = calls
        rest = (content or "")[self.sent:] if content and len(content) > self.sent else ""
        deltas: list[dict[str, Any]] = []
        for k, c in enumerate(calls):
            deltas.append({"index": k, "id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": ""}})
            deltas.append({"index": k, "function": {"arguments": c.arguments}})
        return rest, deltas
