"""A request's fixed edits of its rows' logits, made before anything draws from them (argmax, the
sort-free kernels, the sorting sampler, a verify step's rejection sampling), so every sampler
sees the same distribution:

- ``logit_bias`` (OpenAI's field): a token -> bias map added to the logits;
- ``allowed_token_ids`` (vLLM's): every other token's logit set to -inf;
- ``bad_words`` (vLLM's): a one-token word's token always set to -inf, a longer word's last
  token where the row's latest output tokens are the word's others (the request then runs
  without overlapped steps or speculation, so its output is known on the host).

The edited entries of a step are few (a map or a list per request that has one); one
``index_add_`` and one masked refill over the flattened logits make them all. A decode graph
that would draw every row itself leaves such a step to the sampler, since the edits are not part
of the graph (``ModelRunner._graph_params``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.protocol import WireSamplingParams


@dataclass(frozen=True)
class LogitEdits:
    bias_ids: np.ndarray | None  # int64 token ids of logit_bias
    bias: np.ndarray | None  # float32, one per id
    allowed: np.ndarray | None  # int64 token ids, the only ones that may be drawn
    banned: np.ndarray | None = None  # int64 token ids never drawn (one-token bad words)
    # bad words of several tokens: (the tokens before the last, the last)
    sequences: tuple[tuple[tuple[int, ...], int], ...] = ()

    def banned_after(self, output: Sequence[int]) -> list[int]:
        """The tokens banned at the row that follows ``output`` (its generated tokens)."""
        found = [] if self.banned is None else self.banned.tolist()
        for head, last in self.sequences:
            if len(output) >= len(head) and tuple(output[len(output) - len(head) :]) == head:
                found.append(last)
        return found


def logit_edits(params: WireSamplingParams) -> LogitEdits | None:
    """A request's edits as arrays, built once per request (None: it has none)."""
    words = params.bad_words_token_ids
    if not params.logit_bias and not params.allowed_token_ids and not words:
        return None
    ids = vals = None
    if params.logit_bias:
        n = len(params.logit_bias)
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=n)
        vals = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=n)
    allowed = None
    if params.allowed_token_ids:
        allowed = np.unique(np.asarray(params.allowed_token_ids, dtype=np.int64))
    single = [w[0] for w in words if len(w) == 1]
    banned = np.unique(np.asarray(single, dtype=np.int64)) if single else None
    seqs = tuple((tuple(w[:-1]), w[-1]) for w in words if len(w) > 1)
    return LogitEdits(ids, vals, allowed, banned, seqs)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":  # from pinned memory: a copy from pageable memory may wait for the stream
        return t.pin_memory().to(device, non_blocking=True)
    return t


def apply_logit_edits(
    logits: torch.Tensor,
    edits: Sequence[LogitEdits | None],
    outputs: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """``logits`` [rows, V] with ``edits[i]`` made to row i (None: none), in place where the
    logits are contiguous; ``outputs[i]``: row i's generated tokens so far (the bad words of
    several tokens read them)."""
    if all(e is None for e in edits):
        return logits
    if not logits.is_contiguous():
        logits = logits.contiguous()
    vocab, flat_logits = logits.shape[1], logits.view(-1)
    biased = [(i, e) for i, e in enumerate(edits) if e is not None and e.bias_ids is not None]
    if biased:
        flat = np.concatenate([e.bias_ids + i * vocab for i, e in biased])
        vals = np.concatenate([e.bias for _, e in biased])
        flat_logits.index_add_(
            0, _to_device(flat, logits.device), _to_device(vals, logits.device).to(logits.dtype)
        )
    limited = [(i, e) for i, e in enumerate(edits) if e is not None and e.allowed is not None]
    if limited:
        rows = _to_device(np.asarray([i for i, _ in limited], dtype=np.int64), logits.device)
        keep = _to_device(
            np.concatenate([e.allowed + i * vocab for i, e in limited]), logits.device
        )
        kept = flat_logits.index_select(0, keep)
        logits.index_fill_(0, rows, float("-inf"))
        flat_logits.index_copy_(0, keep, kept)
    bans = [
        np.asarray(e.banned_after(outputs[i] if outputs is not None else ()), dtype=np.int64)
        + i * vocab
        for i, e in enumerate(edits)
        if e is not None and (e.banned is not None or e.sequences)
    ]
    if bans and sum(len(b) for b in bans):
        flat_logits.index_fill_(0, _to_device(np.concatenate(bans), logits.device), float("-inf"))
    return logits
