"""Prompt lookup: find the sequence's last n tokens earlier in its own prompt + output and
propose what followed them there.

    tokens:  ... a b c d e ... x y a b c  ?        n = 3: "a b c" occurred before,
                   └─┬─┘ └─proposal─┘                 followed by "d e ..."

The longest n in [min, max] that matches wins; among its matches the most recent, which in
copy-heavy text (an edit of code above, a quoted passage) is the one being copied."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fulcrum.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return ngram_lookup(
            np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, max_tokens
        )


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (``min_n <= n <= max_n``) of ``tokens``."""
    total = tokens.shape[0]
    if k < 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows starting at 0 .. total - n - 1: each has at least one token after it
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
