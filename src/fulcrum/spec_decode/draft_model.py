"""The scheduler's side of ``draft_model``: how many guesses a request gets. The guesses
themselves are made on the device by the worker's draft model (``worker/draft_model.py``) at the
start of the verify step, so the scheduler hands out placeholders of the right length: the token
budget, the KV slots and the rollback depend only on how many there are."""

from __future__ import annotations

from collections.abc import Sequence

from fulcrum.spec_decode.proposer import Proposer

PLACEHOLDER = 0  # a valid id: the runner overwrites it with the draft's guess on the device


class DraftModelProposer(Proposer):
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return [PLACEHOLDER] * min(self.k, max_tokens)
