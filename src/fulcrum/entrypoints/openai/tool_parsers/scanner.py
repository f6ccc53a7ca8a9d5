"""Tool-call JSON objects found in text that grows a token at a time: each call's name as soon
as its string is complete, and its arguments' raw JSON text as it arrives.

The whole-text parse (``ToolParser.parse``) runs this same scanner over the finished text, so a
streamed call's assembled arguments equal the non-streamed call's arguments character for
character (the model's own JSON text, not a re-serialisation).

Outside an object the scanner only looks for ``{``; the text since the previous object (or the
start) must match the format's ``gap`` (``<tool_call>``, ``,``, ``;`` ...), else scanning stops
and what follows is not a call. Inside, only the top level of the call object is tracked::

    {"name": "f", "arguments": {"a": [1, "}"]}}
     key    value key          value (args_start .. args_end, depth > 1 inside)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ScannedCall:
    name: str | None = None
    args_start: int = -1  # index of the arguments value in the scanned text
    args_end: int = -1  # end of what is known of it (exclusive)
    args_done: bool = False
    args_string: str | None = None  # arguments given as a JSON string: its decoded text
    complete: bool = False  # the object closed


class CallScanner:
    def __init__(self, gap: re.Pattern[str], args_keys: tuple[str, ...]) -> None:
        self.gap, self.args_keys = gap, args_keys
        self.text = ""
        self.calls: list[ScannedCall] = []
        self.stopped = False
        self._i = 0  # next character to scan
        self._gap_start = 0
        self._depth = 0
        self._in_str = self._esc = False
        self._phase = "key"  # key → colon → value → after → key ...
        self._key_start = self._val_start = -1
        self._key: str | None = None

    def feed(self, delta: str) -> None:
        self.text += delta
        t = self.text
        while self._i < len(t) and not self.stopped:
            c, i = t[self._i], self._i
            if self._depth == 0:
                if c == "{":
                    if not self.gap.fullmatch(t, self._gap_start, i):
                        self.stopped = True
                        break
                    self.calls.append(ScannedCall())
                    self._depth, self._phase = 1, "key"
            else:
                self._step(t, c, i)
            self._i += 1

    def streamable_arguments(self, call: ScannedCall) -> str:
        """The arguments text known so far (container values grow; others appear whole)."""
        if call.args_start < 0:
            return "{}" if call.complete else ""
        if call.args_string is not None:
            return call.args_string
        if not call.args_done and self.text[call.args_start] not in "{[":
            return ""
        return self.text[call.args_start : call.args_end]

    def _step(self, t: str, c: str, i: int) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1 and self._phase == "key":
                    self._key, self._phase = _loads(t[self._key_start : i + 1]), "colon"
                elif self._depth == 1 and self._phase == "value":
                    self._end_value(t, i + 1)
            self._grow(i + 1)
            return
        if c == '"':
            self._in_str = True
            if self._depth == 1 and self._phase == "key":
                self._key_start = i
            else:
                self._start_value(i)
        elif c in "{[":
            self._start_value(i)
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1 and self._phase == "value":
                self._end_value(t, i + 1)
            elif self._depth == 0:
                if self._phase == "value" and self._val_start >= 0:  # a bare number / literal
                    self._end_value(t, len(t[:i].rstrip()))
                self.calls[-1].complete = True
                self._gap_start = i + 1
        elif self._depth == 1:
            if c == ":" and self._phase == "colon":
                self._phase, self._val_start = "value", -1
            elif c == ",":
                if self._phase == "value" and self._val_start >= 0:
                    self._end_value(t, len(t[:i].rstrip()))
                self._phase = "key"
            elif not c.isspace():
                self._start_value(i)
        self._grow(i + 1)

    def _start_value(self, i: int) -> None:
        if self._depth != 1 or self._phase != "value" or self._val_start >= 0:
            return
        self._val_start = i
        call = self.calls[-1]
        if self._key in self.args_keys and call.args_start < 0:
            call.args_start = i

    def _grow(self, end: int) -> None:
        call = self.calls[-1] if self.calls else None
        if call is not None and call.args_start == self._val_start >= 0 and not call.args_done:
            call.args_end = end

    def _end_value(self, t: str, end: int) -> None:
        call, start = self.calls[-1], self._val_start
        self._phase = "after"
        if self._key == "name" and call.name is None:
            name = _loads(t[start:end])
            call.name = name if isinstance(name, str) else None
        elif start == call.args_start and not call.args_done:
            call.args_end, call.args_done = end, True
            if t[start] == '"':
                value = _loads(t[start:end])
                call.args_string = value if isinstance(value, str) else ""


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
