"""A chat request's tools on the way out: which calls the output holds, whole or streamed.

``forced`` (``tool_choice`` ``required`` or named): structured output made the text a JSON array
of ``{"name", "parameters"}``, so it always parses. ``auto``: the tool parser decides.

A call counts when its object is complete, names one of the request's tools and its arguments
are JSON (``ToolParser.counted``): the calls are the leading run of such objects, and a
malformed or unknown call ends the run. Streaming passes content through until the parser's
opening text appears; from there it sends each call in OpenAI's delta shape (id, type, name and
the whole arguments text) as soon as its object closes and checks out, so a client never
receives arguments it cannot parse, and the calls it assembles are the ones the non-streamed
response holds. Output with no such call (a malformed object, or one cut by ``max_tokens``)
ends as plain content, streamed or not. The arguments are the model's own JSON text, the same
string either way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulcrum.entrypoints.openai.reasoning import held_tail
from fulcrum.entrypoints.openai.tool_parsers import ForcedParser, ParsedToolCall, ToolParser
from fulcrum.entrypoints.openai.tool_parsers.scanner import CallScanner


@dataclass
class ToolCalls:
    parser: ToolParser | None  # None: forced
    forced: bool = False
    names: frozenset[str] | None = None  # the request's tools (None: any name)

    def __post_init__(self) -> None:
        if self.parser is None:
            self.parser = ForcedParser()

    @property
    def the_parser(self) -> ToolParser:
        assert self.parser is not None
        return self.parser

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        content, calls = self.the_parser.parse(text, self.names)
        if self.forced:  # the text is the calls' JSON: never content, even cut by max_tokens
            return None, calls
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
    ended: bool = False  # a call that does not count was seen: no call after it is sent

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
            # The content before the calls, less its trailing whitespace (as ``parse`` has it);
            # that whitespace stays unsent for ``finish`` should no call count.
            out = self.text[self.sent : at].rstrip()
            self.sent += len(out)
            self.scanner = parser.scanner()
            self.scanner.feed(self.text[at:])
            return out, self._deltas()
        # Keep back a tail that may be the beginning of the opening text, and trailing
        # whitespace, which a call right after it would drop.
        n = len(self.text)
        keep = held_tail(self.text, parser.start)
        end = max(len(self.text[: n - keep].rstrip()), self.sent)
        out, self.sent = self.text[self.sent : end], end
        return out, []

    def _deltas(self) -> list[dict[str, Any]]:
        sc = self.scanner
        assert sc is not None
        out: list[dict[str, Any]] = []
        while not self.ended and len(self.ids) < len(sc.calls):
            call = sc.calls[len(self.ids)]
            if not call.complete:
                break
            parsed = self.tools.the_parser.counted(sc, call, self.tools.names)
            if parsed is None:
                self.ended = True
                break
            k = len(self.ids)
            self.ids.append(parsed.id)
            out.append({"index": k, "id": parsed.id, "type": "function",
                        "function": {"name": parsed.name, "arguments": parsed.arguments}})  # fmt: skip
        return out

    def finish(self) -> str:
        """Content still held back at the end: none once a call was sent (the rest of the text
        belongs to the calls), none in forced mode; else the whole rest, calls that did not
        count included, as the non-streamed message has it."""
        if self.has_calls or self.tools.forced:
            return ""
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest
