"""The xgrammar backend's batched advance and fill (one step's rows together, spread over
threads) equal advancing and filling each matcher alone, rejections included; the manager's
reused host buffers give the masks a fresh one would."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from fulcrum.sampling_params import StructuredOutputsParams as SO
from fulcrum.structured.backend import GrammarBackend
from fulcrum.structured.manager import StructuredOutputManager
from fulcrum.structured.xgrammar_backend import XgrammarBackend

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}  # fmt: skip


def _allowed(mask: np.ndarray, row: int, vocab: int) -> list[int]:
    bits = np.unpackbits(mask[row].view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


@pytest.mark.parametrize("threads", [1, 3])
def test_batched_accept_equals_one_by_one(smollm_tokenizer, threads: int) -> None:
    vocab = 49152
    backend = XgrammarBackend(smollm_tokenizer, vocab, [2], threads=threads)
    compiled = backend.compile(SO(json=json.dumps(SCHEMA)))
    rows = 13  # 3 threads: strided slices of 5, 4 and 4 rows
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
            assert not got[0] and not got[3] and not got[12]
    # the two sets of matchers are in the same states: they allow the same next tokens
    ref = backend.allocate_bitmask(rows)
    backend.fill_bitmasks(batched, mask, list(range(rows)))
    for r, m in enumerate(single):
        m.fill_bitmask(ref, r)
    assert np.array_equal(mask, ref)


def test_manager_reuses_buffers_exactly(smollm_tokenizer) -> None:
    """Masks from the manager's two reused buffers equal fresh ones at every step, as the batch
    shrinks and grows and rows without a grammar (None) come and go."""
    vocab = 49152
    backend = XgrammarBackend(smollm_tokenizer, vocab, [2], threads=2)
    manager = StructuredOutputManager(lambda: backend)
    compiled = backend.compile(SO(json=json.dumps(SCHEMA)))
    matchers = [compiled.new_matcher() for _ in range(9)]
    rng = random.Random(1)
    for step in range(8):
        n = [9, 5, 9, 3, 9, 7, 2, 9][step]
        rows = [m if (r + step) % 3 else None for r, m in enumerate(matchers[:n])]
        got = manager.bitmask(rows).copy()
        want = backend.allocate_bitmask(n)
        for r, m in enumerate(rows):
            if m is not None:
                m.fill_bitmask(want, r)
        assert np.array_equal(got, want)
        for r, m in enumerate(rows):
            if m is not None and not m.is_terminated():
                m.accept_token(rng.choice(_allowed(want, r, vocab)))
    manager.shutdown()
