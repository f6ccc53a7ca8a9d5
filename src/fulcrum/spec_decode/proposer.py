"""The proposer interface.

A proposer sees a request's token ids (prompt + verified output, never unverified guesses) and
returns up to ``max_tokens`` guesses of what follows. It runs on the host inside the scheduler,
so that the guesses are known when the step's token budget is handed out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Proposer(ABC):
    @abstractmethod
    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guessed next tokens of the sequence ``key`` ([] : no guess)."""

    def on_finished(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The sequence ``key`` ended (finished or aborted): drop its state; a proposer that
        learns across requests may keep its output."""
        return None
