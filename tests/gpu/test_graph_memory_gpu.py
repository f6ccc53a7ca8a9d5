"""CUDA graphs keep one bucket's outputs, not every bucket's: a replay's outputs are read before
the next replay, so later captures reuse their memory (``cuda_graph.weak_views``)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from fulcrum.worker.cuda_graph import DecodeGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 1 << 20  # float32 logits: 4 MiB a row


def _forward(ids, pos, meta, out=None):
    """Logits that name their row: ``pos + column``; greedy ids into ``out``."""
    cols = torch.arange(VOCAB, device=pos.device, dtype=torch.float32)
    logits = pos.to(torch.float32)[:, None] + cols
    greedy = logits.argmax(-1)
    if out is not None:
        out.copy_(greedy)
        greedy = out
    return logits, greedy


def test_decode_graphs_hold_one_buckets_logits_and_replays_stay_right() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    gc.collect()
    torch.cuda.empty_cache()
    graphs = DecodeGraphs(_forward, sizes, 4, 16, 64, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphs.capture()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    added = torch.cuda.memory_reserved() - before
    row = VOCAB * 4
    # held per bucket: sum(sizes) = 55 rows; one bucket's: 24 rows (plus the allocator's slack)
    assert added < 36 * row, f"graphs added {added / 2**20:.0f} MiB"

    # bucket after bucket, each replay's logits are its own rows, read before the next replay
    table = torch.zeros(24, 1, dtype=torch.int32).pin_memory()
    for n in (24, 3, 17, 1, 9, 24):
        pos = np.arange(n, dtype=np.int64) + 5
        b = graphs.stage(np.zeros(n, np.int64), pos, np.full(n, -1, np.int64), table[:n])
        logits, ids = graphs.replay(b, n)
        want = torch.arange(n, device="cuda", dtype=torch.float32)[:, None] + 5
        assert torch.equal(logits[:, :3], want + torch.arange(3, device="cuda"))
        assert bool((ids == VOCAB - 1).all())
