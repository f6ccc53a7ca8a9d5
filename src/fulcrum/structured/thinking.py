"""A grammar that waits for a reasoning model's thinking to end (``ThinkingGate``).

The sequence's tokens pass through three phases::

    either ──start_id──> thinking ──end_id──> answer
      └──────── any other token ───────────────┘ (the grammar takes that token)

In ``thinking`` every token is allowed and none reaches the grammar; from the token after
``end_id`` on, the grammar constrains as if the output began there. In ``either`` the first
token may open the thinking or be the answer's first token: its mask is the grammar's plus
``start_id``. The manager fills and advances the grammars of a step's rows together, so the
gate answers two questions for it: which grammar (if any) constrains the next token, and
whether a sampled token is the gate's to consume."""

from __future__ import annotations

import numpy as np

from fulcrum.sampling_params import ThinkingGate
from fulcrum.structured.backend import GrammarMatcher


class GatedMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, gate: ThinkingGate) -> None:
        self.inner, self.gate = inner, gate
        self.phase = gate.opens  # "thinking" | "either" | "answer"
        self._n = 0  # tokens taken
        self._grammar_from: int | None = None  # the first token the grammar took
        # (token that changed the phase, the phase before it): what rollback undoes
        self._changes: list[tuple[int, str]] = []

    def active(self) -> GrammarMatcher | None:
        """The grammar that constrains the next token; None while thinking."""
        return None if self.phase == "thinking" else self.inner

    def opening_token(self) -> int | None:
        """A token allowed beside the grammar's (``start_id`` while the output may open with
        the thinking)."""
        return self.gate.start_id if self.phase == "either" else None

    def take(self, token_id: int) -> bool:
        """Advance the gate by a sampled token: True where the gate consumed it (a thinking
        token, the thinking's end or its opening), False where the grammar must take it."""
        before, at = self.phase, self._n
        self._n += 1
        if before == "answer":
            return False
        if before == "either":
            self.phase = "thinking" if token_id == self.gate.start_id else "answer"
        elif token_id == self.gate.end_id:
            self.phase = "answer"
        if self.phase != before:
            self._changes.append((at, before))
        if self.phase == "answer" and self._grammar_from is None:
            self._grammar_from = at if before == "either" else at + 1
        return not (before == "either" and self.phase == "answer")

    def accept_token(self, token_id: int) -> bool:
        if self.take(token_id) or self.inner.accept_token(token_id):
            return True
        self.untake()
        return False

    def untake(self) -> None:
        """Undo the last ``take``: the grammar refused the token, which leaves the state as
        it was (the ``accept_token`` contract)."""
        self._rewind(self._n - 1)

    def rollback(self, k: int) -> None:
        self.inner.rollback(self._rewind(max(self._n - k, 0)))

    def _rewind(self, n: int) -> int:
        """The gate back to its state after ``n`` tokens; returns how many of the tokens
        dropped the grammar had taken."""
        grammar = 0 if self._grammar_from is None else max(self._n - max(n, self._grammar_from), 0)
        while self._changes and self._changes[-1][0] >= n:
            self.phase = self._changes.pop()[1]
        if self.phase != "answer":
            self._grammar_from = None
        self._n = n
        return grammar

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        grammar = self.active()
        if grammar is None:
            bitmask[row] = -1
            return
        grammar.fill_bitmask(bitmask, row)
        allow_token(bitmask, row, self.opening_token())

    def is_terminated(self) -> bool:
        return self.phase == "answer" and self.inner.is_terminated()


def allow_token(bitmask: np.ndarray, row: int, token_id: int | None) -> None:
    """Set ``token_id``'s bit in ``bitmask[row]`` (int32 words, bit i of word w = token 32w+i)."""
    if token_id is not None:
        bitmask.view(np.uint32)[row, token_id >> 5] |= np.uint32(1 << (token_id & 31))
