"""OpenAI's ``logit_bias``: a request's fixed token -> bias map added to its rows' logits before
anything draws from them (argmax, the sort-free kernels, the sorting sampler, a verify step's
rejection sampling), so every sampler sees the same biased distribution.

The biased entries of a step are few (a map per biased request); one ``index_add_`` over the
flattened logits adds them all. A decode graph that would draw every row itself leaves such a
step to the sampler, since the bias is not part of the graph (``ModelRunner._graph_params``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fulcrum.protocol import WireSamplingParams


def bias_arrays(params: WireSamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """A request's bias as (token ids int64, biases float32), built once per request."""
    if not params.logit_bias:
        return None
    ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
    vals = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(ids))
    return ids, vals


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[tuple[np.ndarray, np.ndarray] | None]
) -> torch.Tensor:
    """``logits`` [rows, V] with ``biases[i]`` added to row i (None: no bias), in place where
    the logits are contiguous."""
    parts = [(i, b) for i, b in enumerate(biases) if b is not None]
    if not parts:
        return logits
    if not logits.is_contiguous():
        logits = logits.contiguous()
    vocab = logits.shape[1]
    flat = torch.from_numpy(np.concatenate([ids + i * vocab for i, (ids, _) in parts]))
    vals = torch.from_numpy(np.concatenate([v for _, (_, v) in parts]))
    if logits.device.type == "cuda":
        # From pinned memory: a copy from pageable memory may wait for the stream.
        flat = flat.pin_memory().to(logits.device, non_blocking=True)
        vals = vals.pin_memory().to(logits.device, non_blocking=True)
    logits.view(-1).index_add_(0, flat, vals.to(logits.dtype))
    return logits
