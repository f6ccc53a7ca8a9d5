"""Suffix decoding: suffix tries over the request's own tokens and over recent requests'
outputs; a proposal follows the most frequent continuation of the longest matched suffix.

Each trie holds every suffix of its texts, cut at ``max_depth`` tokens, with a count per node
(how many times that pattern occurred). Appending a token extends the (at most ``max_depth``)
suffixes still open, so a request's trie grows in O(depth) per token::

    text "a b a b c"      root ─ a(2) ─ b(2) ─ a(1) ...
                               └ b(2) ─ a(1) ─ b(1) ─ c(1)
                                      └ c(1)

Proposing: match the longest suffix of the sequence that has a continuation in a trie, then
walk down the most frequent child while its estimated probability (the product of
child/parent counts along the walk) stays above ``min_token_prob``, for at most
``max_spec_factor * match length`` tokens. The per-request and the global trie each propose;
the one with the larger expected number of accepted tokens (the sum of those probabilities)
wins. The global trie keeps the outputs of the last ``max_cached_requests`` requests: agent
loops and repeated edits reuse far more than their own prompt.

The request's own text is not kept as a trie: :func:`propose_in_text` walks the same trie
implicitly over the token array (a node is the set of positions where its pattern ends, its
count their number), so a request's first guess does not wait for a trie of its whole prompt
(about 100 ms for 600 tokens in Python) and nothing is kept per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fulcrum.spec_decode.proposer import Proposer


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._open: list[tuple[_Node, int]] = []  # (node, depth) of suffixes still growing

    def append(self, token: int) -> None:
        """Extend the text by one token (every open suffix, plus the one starting here)."""
        grown: list[tuple[_Node, int]] = []
        for node, depth in [*self._open, (self.root, 0)]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            if depth + 1 < self.max_depth:
                grown.append((child, depth + 1))
        self._open = grown

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def end_text(self) -> None:
        """The next ``append`` starts an unrelated text (patterns never span two texts)."""
        self._open = []

    def remove_text(self, tokens: Sequence[int]) -> None:
        """Undo ``extend(tokens)`` + ``end_text()`` of a whole text: its counts go, and nodes
        no text reaches any more are dropped."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def propose(
        self, context: Sequence[int], k: int, spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """Guesses after ``context`` and their expected accepted count (sum of probabilities)."""
        n = len(context)
        for start in range(max(0, n - self.max_depth + 1), n):
            node: _Node | None = self.root
            for t in context[start:]:
                node = node.children.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is None or not node.children:
                continue
            length = min(k, max(1, int(spec_factor * (n - start))))
            out: list[int] = []
            prob, score = 1.0, 0.0
            while node.children and len(out) < length:
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / node.count
                if prob < min_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            if out:
                return out, score
        return [], 0.0


def propose_in_text(
    tokens: np.ndarray, max_depth: int, k: int, spec_factor: float, min_prob: float
) -> tuple[list[int], float]:
    """What ``SuffixTrie.propose`` returns for the trie of ``tokens`` (``extend(tokens)``) with
    the context its last ``max_depth`` tokens, found on the array itself. Matched suffixes are
    tried longest first (under ``max_depth``) among those that occurred earlier with a token
    after them (each earlier position of the last token compared back to the text's end in
    one pass); a node of the walk is the array of positions where its pattern ends (its count
    their number, its children the tokens after them), and ties between children go to the
    token whose pattern occurred first, as the trie's insertion order has it."""
    n = tokens.shape[0]
    hi = min(max_depth - 1, n - 1)
    if k < 1 or hi < 1:
        return [], 0.0
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])  # earlier ends, each continued
    if not ends.size:
        return [], 0.0
    # each earlier end's match length with the text's end: the first mismatch walking back
    back = np.arange(hi)
    at = ends[:, None] - back[None, :]
    same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[n - 1 - back][None, :])
    lengths = np.where(same.all(axis=1), hi, same.argmin(axis=1))
    for d in range(int(lengths.max()), 0, -1):
        occ = np.append(ends[lengths >= d], n - 1)
        out, score = _walk(tokens, occ, d, max_depth, min(k, max(1, int(spec_factor * d))),
                           min_prob)  # fmt: skip
        if out:
            return out, score
    return [], 0.0


def _walk(
    tokens: np.ndarray, occ: np.ndarray, depth: int, max_depth: int, length: int, min_prob: float
) -> tuple[list[int], float]:
    """Down the most frequent child from the node whose pattern ends at ``occ`` (every
    occurrence in order, the text's last position included)."""
    n = tokens.shape[0]
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < length and depth < max_depth:
        cont = occ[occ < n - 1]
        if not cont.size:
            break
        nxt = tokens[cont + 1]
        counts: dict[int, int] = {}
        for t in nxt.tolist():  # in text order: the first maximum is the trie's
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


class SuffixProposer(Proposer):
    def __init__(
        self, max_depth: int, max_cached_requests: int, spec_factor: float, min_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.spec_factor = spec_factor
        self.min_prob = min_prob
        self.global_trie = SuffixTrie(max_depth)
        self._outputs: OrderedDict[str, list[int]] = OrderedDict()  # in the global trie

    def propose(self, key: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens < 1:
            return []
        best, best_score = propose_in_text(
            np.asarray(token_ids, dtype=np.int64), self.max_depth, max_tokens,
            self.spec_factor, self.min_prob,
        )  # fmt: skip
        if self._outputs:
            context = token_ids[-self.max_depth :]
            other, score = self.global_trie.propose(
                context, max_tokens, self.spec_factor, self.min_prob
            )
            if score > best_score:
                best = other
        return best

    def on_finished(self, key: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        if self.max_cached == 0:
            return
        output = list(token_ids[num_prompt_tokens:])
        if not output:
            return
        old = self._outputs.pop(key, None)
        if old is not None:
            self.global_trie.remove_text(old)
        self.global_trie.extend(output)
        self.global_trie.end_text()
        self._outputs[key] = output
        while len(self._outputs) > self.max_cached:
            _, evicted = self._outputs.popitem(last=False)
            self.global_trie.remove_text(evicted)
