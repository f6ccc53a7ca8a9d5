"""The grammar backend interface: compile a constraint once, then one matcher per sequence.

A matcher advances only on tokens the scheduler accepted (``accept_token``), fills the next
step's allowed-token bitmask on the host (``fill_bitmask``) and can undo its last ``k`` tokens
(``rollback``: speculative tokens that were rejected)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from fulcrum.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, bit i = token i)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may follow."""


class CompiledGrammar(ABC):
    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer. ``compile`` may run on worker threads."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An all-allowed bitmask of ``rows`` rows (int32 ``[rows, ceil(vocab / 32)]``)."""

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        """``matchers[i]`` fills ``bitmask[rows[i]]``; a backend may spread the rows over
        threads (the filling is per-step host work that grows with the batch)."""
        for m, row in zip(matchers, rows, strict=True):
            m.fill_bitmask(bitmask, row)

    def accept_tokens(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """``matchers[i].accept_token(tokens[i])`` for each i; a backend may advance the
        matchers side by side (one step's advance is host work that grows with the batch)."""
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]

    def close(self) -> None:
        """Release the backend's threads (the engine is shutting down); none by default."""
        return None
