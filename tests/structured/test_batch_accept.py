"""The xgrammar backend's batched advance (one step's rows together) equals advancing each
matcher alone, rejections included."""

from __future__ import annotations

import json
import random

import numpy as np

from fulcrum.sampling_params import StructuredOutputsParams as SO
from fulcrum.structured.backend import GrammarBackend
from fulcrum.structured.xgrammar_backend import XgrammarBackend

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}  # fmt: skip


def _allowed(mask: np.ndarray, row: int, vocab: int) -> list[int]:
    bits = np.unpackbits(mask[row].view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


def test_batched_accept_equals_one_by_one(smollm_tokenizer) -> None:
    vocab = 49152
    backend = XgrammarBackend(smollm_tokenizer, vocab, [2])
    compiled = backend.compile(SO(json=json.dumps(SCHEMA)))
    rows = 6
    batched = [compiled.new_matcher() for _ in range(rows)]
    single = [compiled.new_matcher() for _ in range(rows)]
    rng = random.Random(0)
    mask = backend.allocate_bitmask(rows)
    for step in range(12):
        backend.fill_bitmasks(batched, mask, list(range(rows)))
        toks = []
        for r in range(rows):
            ok = _allowed(mask, r, vocab)
            # every third row on odd steps offers a token its grammar forbids
            bad = step % 2 == 1 and r % 3 == 0
            toks.append(next(t for t in range(vocab) if t not in set(ok)) if bad else rng.choice(ok))
        got = backend.accept_tokens(batched, toks)
        want = GrammarBackend.accept_tokens(backend, single, toks)
        assert got == want
        if step % 2 == 1:
            assert not got[0] and not got[3]
    # the two sets of matchers are in the same states: they allow the same next tokens
    ref = backend.allocate_bitmask(rows)
    backend.fill_bitmasks(batched, mask, list(range(rows)))
    for r, m in enumerate(single):
        m.fill_bitmask(ref, r)
    assert np.array_equal(mask, ref)
