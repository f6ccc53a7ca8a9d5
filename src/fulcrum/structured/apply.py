"""Apply a step's grammar bitmask to the logits on their device: disallowed tokens get -inf.

xgrammar's ``apply_token_bitmask_inplace`` is one Triton/CUDA kernel on the GPU and a vectorised
loop on the CPU; rows whose bitmask allows everything are skipped."""

from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """``logits`` [rows, V] masked by ``bitmask`` [rows, ceil(V/32)] (host int32), in place
    when the dtype allows (xgrammar needs float32/16/bf16 and contiguous rows)."""
    rows = np.flatnonzero((bitmask != -1).any(axis=1))
    if not len(rows):
        return logits
    if not logits.is_contiguous():
        logits = logits.contiguous()
    mask = torch.from_numpy(bitmask)
    # no row list where every row is masked; else the rows, on the logits' device
    indices = None if len(rows) == len(bitmask) else torch.from_numpy(rows.astype(np.int32))
    if logits.device.type == "cuda":
        # Both copies from pinned memory: a copy from pageable memory may wait for the stream,
        # i.e. for the forward this host work is meant to overlap. The structured-output
        # manager's masks are pinned already.
        if not mask.is_pinned():
            mask = mask.pin_memory()
        mask = mask.to(logits.device, non_blocking=True)
        if indices is not None:
            indices = indices.pin_memory().to(logits.device, non_blocking=True)
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=indices)
    return logits
