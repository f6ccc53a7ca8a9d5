"""Reasoning models' thinking, split from their answer: a chat message's ``reasoning_content``
beside its ``content`` (vLLM's field), whole or streamed. ``--reasoning-parser``:

``deepseek_r1``  everything up to ``</think>`` is reasoning (DeepSeek-R1 and its distills: the
                 chat template may write the opening ``<think>`` itself, so the output can start
                 inside it); an output without ``</think>`` is all reasoning (cut short).
``qwen3``        an output that opens with ``<think>`` reasons up to ``</think>`` (or its end);
                 one that does not is all content (thinking switched off through
                 ``chat_template_kwargs: {"enable_thinking": false}``).

The content that follows goes on to the tool-call parser, if the request has tools. A request
with structured output constrains only that content: the thinking stays free (``ReasoningParser.gate``),
where the tokenizer holds both markers as single tokens (every reasoning model's does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fulcrum.sampling_params import ThinkingGate

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_inside: bool  # the output may begin inside the thinking, without START

    def gate(self, markers: tuple[int, int], prompt: Sequence[int]) -> ThinkingGate | None:
        """Where the answer's grammar starts, from the prompt's last thinking marker (vLLM's
        rule): after ``</think>`` the thinking is over (e.g. switched off by the template) and
        the grammar covers the whole output (None); after ``<think>`` the output begins inside
        the thinking; with neither, as the parser reads outputs."""
        start, end = markers
        for tok in reversed(prompt):
            if tok == end:
                return None
            if tok == start:
                return ThinkingGate(start, end, "thinking")
        return ThinkingGate(start, end, "thinking" if self.opens_inside else "either")

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole output (None: no reasoning)."""
        if text.startswith(START):
            text = text[len(START) :]
        elif not self.opens_inside:
            return None, text
        at = text.find(END)
        if at < 0:
            return text, ""
        return text[:at], text[at + len(END) :]


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"reasoning_parser: unknown parser {name!r}; choose one of {', '.join(PARSERS)}."
        ) from None


def marker_ids(tokenizer: Any) -> tuple[int, int] | None:
    """``(<think>, </think>)`` ids where each is one token of ``tokenizer``, else None (the
    grammar then covers the thinking too: it cannot tell where a split marker ends)."""
    ids = []
    for marker in (START, END):
        enc = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            return None
        ids.append(int(enc[0]))
    return ids[0], ids[1]


def held_tail(text: str, token: str) -> int:
    """Length of the longest tail of ``text`` that may be the beginning of ``token``: what a
    stream holds back until the next delta says whether ``token`` follows."""
    return next((k for k in range(min(len(token) - 1, len(text)), 0, -1)
                 if token.startswith(text[-k:])), 0)  # fmt: skip


@dataclass
class ReasoningStream:
    """One streamed choice: each delta's reasoning part and content part. Text that may be the
    beginning of ``<think>`` (at the start) or ``</think>`` is held back until it is known."""

    parser: ReasoningParser
    text: str = ""
    sent: int = 0  # characters of ``text`` handled
    phase: str = "start"  # start -> reasoning -> content

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        if self.phase == "start":
            if START.startswith(self.text) and len(self.text) < len(START):
                return "", ""  # may still become <think>
            if self.text.startswith(START):
                self.sent, self.phase = len(START), "reasoning"
            else:
                self.phase = "reasoning" if self.parser.opens_inside else "content"
        if self.phase == "content":
            out, self.sent = self.text[self.sent :], len(self.text)
            return "", out
        at = self.text.find(END, self.sent)
        if at >= 0:
            reasoning, content = self.text[self.sent : at], self.text[at + len(END) :]
            self.sent, self.phase = len(self.text), "content"
            return reasoning, content
        end = len(self.text) - held_tail(self.text[self.sent :], END)
        out, self.sent = self.text[self.sent : end], end
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output: reasoning, or content where the
        output never left the start (a prefix of ``<think>`` and nothing more)."""
        rest, self.sent = self.text[self.sent :], len(self.text)
        if self.phase == "start" and not self.parser.opens_inside:
            return "", rest
        return rest, ""
