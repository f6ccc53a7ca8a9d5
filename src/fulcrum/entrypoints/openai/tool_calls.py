"""A chat request's tools on the way out: which calls the output holds, whole or streamed.

``forced`` (``tool_choice`` ``required`` or named): structured output made the text a JSON array
of ``{"name", "parameters"}``, so it always parses. ``auto``: the tool parser decides. Streaming
passes content through until the parser's opening text appears; from there an incremental
scanner sends each call in OpenAI's delta shape as the model writes it: id, type and name once
the name is complete, then the arguments' text in fragments. The fragments are the model's own
JSON text, the same string the non-streamed response carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulcrum.entrypoints.openai.tool_parsers import ForcedParser, ParsedToolCall, ToolParser
from fulcrum.entrypoints.openai.tool_parsers.base import new_call_id
from fulcrum.entrypoints.openai.tool_parsers.scanner import CallScanner


@dataclass
class ToolCalls:
    parser: ToolParser | None  # None: forced
    forced: bool = False

    def __post_init__(self) -> None:
        if self.parser is None:
            self.parser = ForcedParser()

    @property
    def the_parser(self) -> ToolParser:
        assert self.parser is not None
        return self.parser

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        content, calls = self.the_parser.parse(text)
        if self.forced:  # no calls: cut by max_tokens, the text is all there is
            return (None if calls else text), calls
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
    """One choice's streamed text: the content to send now and the tool-call deltas."""

    tools: ToolCalls
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    scanner: CallScanner | None = None  # set once the calls began
    ids: list[str] = field(default_factory=list)  # one per call sent
    args_sent: list[int] = field(default_factory=list)  # argument characters sent per call

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send and tool-call deltas (one entry per call index) for ``delta``."""
        self.text += delta
        if self.scanner is not None:
            self.scanner.feed(delta)
            return "", self._deltas()
        parser = self.tools.the_parser
        at = parser.find_start(self.text)
        if at >= 0:
            out, self.sent = self.text[self.sent : at], at
            self.scanner = parser.scanner()
            self.scanner.feed(self.text[at:])
            return out, self._deltas()
        # Keep back a tail that may be the beginning of the opening text.
        start, n = parser.start, len(self.text)
        keep = next((k for k in range(min(len(start) - 1, n), 0, -1)
                     if start.startswith(self.text[-k:])), 0)
        out, self.sent = self.text[self.sent : n - keep], n - keep
        return out, []

    def _deltas(self) -> list[dict[str, Any]]:
        sc = self.scanner
        assert sc is not None
        out: list[dict[str, Any]] = []
        for k, call in enumerate(sc.calls):
            if call.name is None:
                break
            entry: dict[str, Any] | None = None
            if k == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                entry = {"index": k, "id": self.ids[k], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            args = sc.streamable_arguments(call)
            frag = args[self.args_sent[k] :]
            if frag:
                self.args_sent[k] = len(args)
                entry = entry or {"index": k, "function": {"arguments": ""}}
                entry["function"]["arguments"] += frag
            if entry is not None:
                out.append(entry)
        return out

    def finish(self) -> str:
        """Content still held back at the end (nothing once a call was sent)."""
        if self.has_calls:
            return ""
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest
