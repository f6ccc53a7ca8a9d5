"""The proposer interface.

A proposer sees a request's token ids (prompt + verified output, never unverified guesses) and
returns up to ``max_tokens`` guesses of what follows. It runs on the host inside the scheduler,
so that the guesses are known when the step's token budget is handed out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


class Proposer(ABC):
    @abstractmethod
    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guessed next tokens of the sequence ``key`` ([] : no guess)."""

    def on_finished(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The sequence ``key`` ended (finished or aborted): drop its state; a proposer that
        learns across requests may keep its output."""
        return None


class TokenArrays:
    """Each running sequence's token ids as a NumPy array, kept from step to step. The ids only
    grow (verified tokens are appended; guesses never are), so a step copies the few new ones
    instead of converting the whole list again for every request that guesses, on the host
    while the device waits."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def get(self, key: str, token_ids: Sequence[int]) -> np.ndarray:
        n = len(token_ids)
        buf, seen = self._arrays.get(key, (None, 0))
        if buf is None or seen > n:  # new, or recomputed from a shorter history
            buf, seen = np.empty(max(2 * n, 64), dtype=np.int64), 0
        elif buf.shape[0] < n:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:seen] = buf[:seen]
            buf = grown
        if n > seen:
            buf[seen:n] = token_ids[seen:n]
        self._arrays[key] = (buf, n)
        return buf[:n]

    def drop(self, key: str) -> None:
        self._arrays.pop(key, None)
