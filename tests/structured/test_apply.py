"""The bitmask on the logits equals a plain torch reference: bit i of row r clear -> -inf."""

from __future__ import annotations

import numpy as np
import torch

from fulcrum.structured.apply import apply_bitmask


def _reference(logits: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(len(mask), -1)
    allowed = torch.from_numpy(bits[:, : logits.shape[1]].astype(bool))
    return logits.masked_fill(~allowed, float("-inf"))


def test_apply_bitmask_matches_reference() -> None:
    rng = np.random.default_rng(1)
    for vocab in (37, 64, 1000):
        logits = torch.randn(4, vocab)
        mask = rng.integers(-(2**31), 2**31, size=(4, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        mask[1] = -1
        out = apply_bitmask(logits.clone(), mask)
        assert torch.equal(out, _reference(logits, mask))
        assert torch.equal(out[1], logits[1])


def test_every_row_masked_and_none() -> None:
    """Every row constrained (no row list passed down) and no row constrained (logits as they
    were)."""
    rng = np.random.default_rng(2)
    logits = torch.randn(3, 100)
    mask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    mask[mask == -1] = 0
    assert torch.equal(apply_bitmask(logits.clone(), mask), _reference(logits, mask))
    free = np.full((3, 4), -1, dtype=np.int32)
    assert torch.equal(apply_bitmask(logits.clone(), free), logits)
