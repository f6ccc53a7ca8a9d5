"""Prompt lookup: find the sequence's last n tokens earlier in its own prompt + output and
propose what followed them there.

    tokens:  ... a b c d e ... x y a b c  ?        n = 3: "a b c" occurred before,
                   └─┬─┘ └─proposal─┘                 followed by "d e ..."

The longest n in [min, max] that matches wins; among its matches the most recent, which in
copy-heavy text (an edit of code above, a quoted passage) is the one being copied."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fulcrum.spec_decode.proposer import Proposer, TokenArrays


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.arrays = TokenArrays()

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return ngram_lookup(self.arrays.get(key, token_ids), self.min_n, self.max_n, max_tokens)

    def on_finished(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.arrays.drop(key)


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (``min_n <= n <= max_n``) of ``tokens``.

    Grows the match backwards from the earlier positions of the last token, keeping at each
    length those that still match: at most ``max_n`` passes over a shrinking set of positions,
    where testing each n against every window cost a pass over the whole sequence per n (a
    single-stream verify step on a small model waits for this on the host)."""
    total = tokens.shape[0]
    hi = min(max_n, total - 1)
    if k < 1 or hi < max(min_n, 1):
        return []
    # ends of earlier occurrences (each with at least one token after it) matching n tokens
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    n = 1
    while ends.size and n < hi:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[total - 1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[-1]) + 1
    return tokens[start : start + k].tolist()
