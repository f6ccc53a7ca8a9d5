"""Suffix decoding: guesses from the request's own tokens and from recent requests' outputs;
a proposal follows the most frequent continuation of the longest matched suffix.

The model is a suffix trie of each text, cut at ``max_depth`` tokens, with a count per node
(how many times that pattern occurred)::

    text "a b a b c"      root ─ a(2) ─ b(2) ─ a(1) ...
                               └ b(2) ─ a(1) ─ b(1) ─ c(1)
                                      └ c(1)

Proposing: match the longest suffix of the sequence that has a continuation, then walk down the
most frequent child while its estimated probability (the product of child/parent counts along
the walk) stays above ``min_token_prob``, for at most ``max_spec_factor * match length`` tokens.
The request's own text and the outputs of the last ``max_cached_requests`` finished requests
(agent loops and repeated edits reuse far more than their own prompt) each propose; the one with
the larger expected number of accepted tokens (the sum of those probabilities) wins.

No trie is built. A node is the array of positions where its pattern ends in a token array
(its count their number, its children the tokens after them), so both walks run on arrays:
the request's token ids, and one buffer of the finished outputs with -1 between texts (a
pattern never spans two), indexed by token. A trie of Python objects grows by about
``max_depth`` nodes per token: a request's first guess waited for its whole prompt's trie, and
the finished outputs' nodes filled memory and stalled the engine's loop in the garbage
collector (BENCHMARKS §12.1.1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fulcrum.spec_decode.proposer import Proposer, TokenArrays

_SEP = -1  # between texts and after the last: never a token, never matched or proposed


def propose_in_text(
    tokens: np.ndarray, max_depth: int, k: int, spec_factor: float, min_prob: float
) -> tuple[list[int], float]:
    """Guesses after ``tokens`` from ``tokens`` themselves (the trie of that one text, the
    context its last ``max_depth`` tokens) and their expected accepted count."""
    n = tokens.shape[0]
    if k < 1 or n < 2:
        return [], 0.0
    text = np.append(tokens, _SEP)
    ends = np.flatnonzero(text[: n - 1] == tokens[n - 1])  # earlier ends, each continued
    # the text's own end is an occurrence of every suffix: counted, never continued
    return _longest_first(text, ends, tokens, n - 1, max_depth, k, spec_factor, min_prob)


def _longest_first(
    text: np.ndarray,
    ends: np.ndarray,
    context: np.ndarray,
    own_end: int | None,
    max_depth: int,
    k: int,
    spec_factor: float,
    min_prob: float,
) -> tuple[list[int], float]:
    """Matched suffixes of ``context``, longest first (under ``max_depth``), at positions
    ``ends`` of ``text`` (ascending: each earlier position of the context's last token, compared
    back to the context's end in one pass); the first whose walk yields a guess wins.
    ``own_end``: a position of ``text`` that ends every suffix (the context itself)."""
    hi = min(max_depth - 1, context.shape[0] - (own_end is not None))
    if not ends.size or hi < 1:
        return [], 0.0
    lengths = _match_lengths(text, ends, context, hi)
    for d in range(int(lengths.max()), 0, -1):
        occ = ends[lengths >= d]
        if own_end is not None:
            occ = np.append(occ, own_end)
        out, score = _walk(text, occ, d, max_depth, min(k, max(1, int(spec_factor * d))),
                           min_prob)  # fmt: skip
        if out:
            return out, score
    return [], 0.0


def _match_lengths(text: np.ndarray, ends: np.ndarray, context: np.ndarray, hi: int) -> np.ndarray:
    """How many of the context's last tokens (at most ``hi``) end at each of ``ends``: all
    at once for a few positions; level by level over the shrinking set for many (a common
    token)."""
    tail = context[context.shape[0] - 1 - np.arange(hi)]  # the context backwards
    if ends.size * hi <= 8192:
        at = ends[:, None] - np.arange(hi)[None, :]
        same = (at >= 0) & (text[np.maximum(at, 0)] == tail[None, :])
        return np.where(same.all(axis=1), hi, same.argmin(axis=1))
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.arange(ends.size)
    for j in range(1, hi):
        at = ends[alive] - j
        alive = alive[(at >= 0) & (text[np.maximum(at, 0)] == tail[j])]
        if not alive.size:
            break
        lengths[alive] += 1
    return lengths


def _walk(
    text: np.ndarray, occ: np.ndarray, depth: int, max_depth: int, length: int, min_prob: float
) -> tuple[list[int], float]:
    """Down the most frequent child from the node whose pattern ends at ``occ`` (every
    occurrence, in text order) in ``text`` (``_SEP`` after each text)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < length and depth < max_depth and occ.size:
        nxt = text[occ + 1]
        cont = occ[nxt != _SEP]
        if not cont.size:
            break
        nxt = nxt[nxt != _SEP]
        counts: dict[int, int] = {}
        for t in nxt.tolist():  # in text order: the first maximum is the trie's first child
            counts[t] = counts.get(t, 0) + 1
        tok, c = max(counts.items(), key=lambda kv: kv[1])
        prob *= c / occ.size
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        occ = cont[nxt == tok] + 1
        depth += 1
    return out, score


class OutputCorpus:
    """Finished requests' outputs in one buffer, ``_SEP`` after each, with the positions of each
    token: a sorted index of the buffer's front and a linear scan of what was added since
    (re-indexed once it outgrows a quarter of the front). A removed text's tokens become
    ``_SEP`` in place; the buffer is compacted once removed tokens outnumber live ones."""

    def __init__(self) -> None:
        self.text = np.full(1, _SEP, dtype=np.int64)  # position 0: a separator
        self.spans: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> [start, end)
        self._live = 0
        self._dead = 0
        self._indexed = 0  # text[:_indexed] is in the sorted index
        self._order = np.zeros(0, dtype=np.int64)  # positions sorted by token, then position
        self._sorted = np.zeros(0, dtype=np.int64)  # text[_order]

    def __len__(self) -> int:
        return len(self.spans)

    def add(self, key: str, tokens: Sequence[int]) -> None:
        start = self.text.shape[0]
        self.text = np.concatenate([self.text, np.asarray(tokens, dtype=np.int64), [_SEP]])
        self.spans[key] = (start, start + len(tokens))
        self._live += len(tokens)
        if self.text.shape[0] - self._indexed > max(4096, self._indexed // 4):
            self._reindex()

    def remove(self, key: str) -> None:
        start, end = self.spans.pop(key)
        self.text[start:end] = _SEP
        self._live -= end - start
        self._dead += end - start
        if self._dead > max(4096, self._live):
            self._compact()

    def _compact(self) -> None:
        """The live texts moved together, in order, in one copy; then one re-index."""
        parts, spans, pos = [self.text[:1]], OrderedDict(), 1
        for key, (start, end) in self.spans.items():
            parts += [self.text[start : end + 1]]  # the text and the separator after it
            spans[key] = (pos, pos + end - start)
            pos += end - start + 1
        self.text, self.spans, self._dead = np.concatenate(parts), spans, 0
        self._reindex()

    def oldest(self) -> str:
        return next(iter(self.spans))

    def _reindex(self) -> None:
        self._order = np.argsort(self.text, kind="stable")
        self._sorted = self.text[self._order]
        self._indexed = self.text.shape[0]

    def positions(self, token: int) -> np.ndarray:
        """Where ``token`` stands in live texts, ascending."""
        lo, hi = np.searchsorted(self._sorted, [token, token + 1])
        front = self._order[lo:hi]
        front = front[self.text[front] == token]  # removed texts' positions are _SEP now
        rest = np.flatnonzero(self.text[self._indexed :] == token) + self._indexed
        return np.concatenate([front, rest]) if rest.size else front

    def propose(
        self, context: np.ndarray, max_depth: int, k: int, spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """Guesses after ``context`` from the outputs (their trie, the context's last
        ``max_depth`` tokens matched) and their expected accepted count."""
        if k < 1 or not context.shape[0] or not self.spans:
            return [], 0.0
        context = context[-max_depth:]
        ends = self.positions(int(context[-1]))
        return _longest_first(self.text, ends, context, None, max_depth, k, spec_factor,
                              min_prob)  # fmt: skip


class SuffixProposer(Proposer):
    def __init__(
        self, max_depth: int, max_cached_requests: int, spec_factor: float, min_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.spec_factor = spec_factor
        self.min_prob = min_prob
        self.outputs = OutputCorpus()
        self.arrays = TokenArrays()

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens < 1:
            return []
        tokens = self.arrays.get(key, token_ids)
        best, best_score = propose_in_text(
            tokens, self.max_depth, max_tokens, self.spec_factor, self.min_prob
        )
        if len(self.outputs):
            other, score = self.outputs.propose(
                tokens, self.max_depth, max_tokens, self.spec_factor, self.min_prob
            )
            if score > best_score:
                best = other
        return best

    def on_finished(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.arrays.drop(key)
        if self.max_cached == 0:
            return
        output = token_ids[num_prompt_tokens:]
        if not len(output):
            return
        if key in self.outputs.spans:
            self.outputs.remove(key)
        self.outputs.add(key, output)
        while len(self.outputs) > self.max_cached:
            self.outputs.remove(self.outputs.oldest())
