"""Batched sampling without host sync: penalties, filters, seeded draws and logprobs.

Per step, for a batch of B rows over a vocabulary of V tokens:

```
logits [B, V] ──► log_softmax ──────────────────────────────► logprobs (raw model distribution)
   │
   ├─ penalties (repetition over prompt+output; frequency, presence over output)
   ├─ min_tokens: stop ids ──► -inf
   ├─ greedy rows: argmax
   └─ random rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► argmax(probs / q)
                                                              q ~ Exponential(1), per-row
                                                              generator for seeded requests
```

Every step runs on the logits' device; Python lists (token histories, stop ids) only travel
host → device, so nothing inside ``Sampler.forward`` waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.config import KernelConfig
from fulcrum.kernels.dispatch import DEFAULT, use_triton
from fulcrum.protocol import WireSamplingParams
from fulcrum.sampling_params import SamplingParams

_PAD = -1  # placeholder in padded token-id tensors; remapped to an extra vocab column


def _to_device(data: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list → device tensor without blocking the host (pinned staging on CUDA)."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _padded(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, max_len] int64 of token ids, padded with ``_PAD``."""
    width = max((len(r) for r in rows), default=0)
    data = [list(r) + [_PAD] * (width - len(r)) for r in rows]
    if width == 0:
        return torch.empty((len(rows), 0), dtype=torch.int64, device=device)
    return _to_device(data, torch.int64, device)


def _token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] int64: how often each token occurs in each row."""
    ids = _padded(rows, device)
    ids = torch.where(ids == _PAD, vocab_size, ids)  # padding lands in a scratch column
    counts = torch.zeros((len(rows), vocab_size + 1), dtype=torch.int64, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def greedy_argmax(
    logits: torch.Tensor, out: torch.Tensor | None = None, kc: KernelConfig = DEFAULT
) -> torch.Tensor:
    """Row-wise argmax (first maximum on ties), into ``out`` (int64 ``[n]``) when given. A few
    rows on CUDA: one Triton launch (``kernels/argmax.py``, when ``kc.argmax_kernel``).
    Elsewhere, in two stages for small batches: a one-row reduction over a 128k vocabulary runs
    on a single block, so split each row into chunks, reduce the chunks in parallel, then pick
    among the chunk maxima."""
    n, vocab = logits.shape
    if kc.argmax_kernel and use_triton(logits, kc):
        from fulcrum.kernels import argmax

        if n <= argmax.MAX_ROWS and logits.stride(-1) == 1:
            return argmax.argmax_rows(logits, out, kc.pdl)
    chunks = next((c for c in (64, 48, 32, 16) if vocab % c == 0), 0)
    if n >= 32 or not chunks:
        ids = logits.argmax(dim=-1)
    else:
        width = vocab // chunks
        vals, idx = logits.view(n, chunks, width).max(dim=-1)
        best = vals.argmax(dim=-1, keepdim=True)  # first chunk holding the row maximum
        ids = (best * width + idx.gather(1, best)).squeeze(1)
    return ids if out is None else out.copy_(ids)


def _draw_only(p: WireSamplingParams) -> bool:
    """No penalties, no min_tokens mask, no logprobs: the row's token is a draw and nothing else."""
    return (
        p.logprobs is None
        and p.min_tokens == 0
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


def plain_greedy(p: WireSamplingParams) -> bool:
    """Argmax is the whole sampler: greedy, and nothing but the draw."""
    return p.temperature == 0.0 and _draw_only(p)


def fused_sampling(p: WireSamplingParams) -> bool:
    """Whether ``kernels/sample.py`` can draw this row's token by itself: temperature, top-p or
    top-k (not both: top-p over the top-k set needs its mass) and min-p, seeded or not, with
    nothing but the draw. (Whether it does is the step's ``KernelConfig.fused_sampler``.)"""
    return _draw_only(p) and not (p.top_k > 0 and p.top_p < 1.0)


def fused_params(
    params: Sequence[WireSamplingParams], indices: Sequence[int], positions: Sequence[int]
) -> np.ndarray:
    """The sort-free kernels' ``[n, 6]`` int32 rows (``kernels/sample.pack_params``) for rows
    that all pass ``fused_sampling``: temperature, top-k, top-p, min-p and the noise key. A
    seeded row's key follows from its seed, its ``indices`` entry (its place among the
    request's n samples) and ``positions`` entry (the sampled token's position)."""
    from fulcrum.kernels.sample import pack_params, random_keys, seeded_key

    keys = random_keys(len(params))
    for i, p in enumerate(params):
        if p.seed is not None:
            keys[i] = seeded_key(p.seed, indices[i], int(positions[i]))
    return pack_params([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], keys)


def sample_fused(
    logits: torch.Tensor,
    params: Sequence[WireSamplingParams],
    indices: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    """One token per row, sort-free, for rows that all pass ``fused_sampling`` (their noise
    keys as ``fused_params`` gives them)."""
    from fulcrum.kernels.sample import sample_rows

    rows = fused_params(params, indices, positions)
    return sample_rows(logits, _to_device(rows, torch.int32, logits.device))


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one batch; row ``i`` is the ``i``-th logits row.

    Optional tensors are ``None`` when no row of the batch uses the feature, so the sampler can
    skip the work entirely.
    """

    temperature: torch.Tensor  # [B] float32; 0.0 means greedy for that row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, <= 0 or >= vocab means off
    top_p: torch.Tensor | None  # [B] float32 (1.0 = off)
    min_p: torch.Tensor | None  # [B] float32 (0.0 = off)
    generators: dict[int, torch.Generator]  # row -> seeded generator on the logits' device
    presence_penalty: torch.Tensor | None  # [B] float32 (0.0 = off)
    frequency_penalty: torch.Tensor | None  # [B] float32 (0.0 = off)
    repetition_penalty: torch.Tensor | None  # [B] float32 (1.0 = off)
    output_token_ids: list[list[int]]  # generated so far, per row
    prompt_token_ids: list[list[int]] | None  # per row; needed by the repetition penalty only
    max_num_logprobs: int | None  # None: no row asked for logprobs
    min_tokens_stop_ids: dict[int, set[int]]  # row -> ids masked while below min_tokens

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Make the batch tensors from per-row parameters, skipping features no row uses.

        ``generators[i]`` is row ``i``'s seeded generator (``None`` when unseeded);
        ``prompt_token_ids`` may be ``None`` if no row uses a repetition penalty.
        """
        device = torch.device(device)
        if not (len(params) == len(generators) == len(output_token_ids)):
            raise ValueError("params, generators and output_token_ids must have one entry per row")

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return _to_device(values, dtype, device)

        greedy = [p.greedy for p in params]
        use_top_k = any(0 < p.top_k < vocab_size for p in params)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        if use_rep and prompt_token_ids is None:
            raise ValueError("repetition_penalty needs prompt_token_ids")
        asked = [p.logprobs for p in params if p.logprobs is not None]
        min_tokens_stop_ids: dict[int, set[int]] = {}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                ids = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    ids |= set(p.all_stop_token_ids)
                ids = {t for t in ids if t < vocab_size}
                if ids:
                    min_tokens_stop_ids[i] = ids
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=column([p.top_k for p in params], torch.int64) if use_top_k else None,
            top_p=(
                column([p.top_p for p in params], torch.float32)
                if any(p.top_p < 1.0 for p in params)
                else None
            ),
            min_p=(
                column([p.min_p for p in params], torch.float32)
                if any(p.min_p > 0.0 for p in params)
                else None
            ),
            generators={i: g for i, g in enumerate(generators) if g is not None},
            presence_penalty=(
                column([p.presence_penalty for p in params], torch.float32)
                if any(p.presence_penalty != 0.0 for p in params)
                else None
            ),
            frequency_penalty=(
                column([p.frequency_penalty for p in params], torch.float32)
                if any(p.frequency_penalty != 0.0 for p in params)
                else None
            ),
            repetition_penalty=(
                column([p.repetition_penalty for p in params], torch.float32) if use_rep else None
            ),
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids if use_rep else None,
            max_num_logprobs=max(asked) if asked else None,
            min_tokens_stop_ids=min_tokens_stop_ids,
        )


@dataclass
class SamplerOutput:
    """Sampled tokens, plus logprobs of the raw model distribution when any row asked."""

    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: torch.Tensor | None  # [B, K+1] float32: col 0 = sampled token, then the top K
    logprob_token_ids: torch.Tensor | None  # [B, K+1] int64
    sampled_ranks: torch.Tensor | None  # [B] int64, rank of the sampled token (1 = most likely)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt+output), frequency and presence (output) penalties, vLLM semantics."""
    rep, freq, pres = meta.repetition_penalty, meta.frequency_penalty, meta.presence_penalty
    if rep is None and freq is None and pres is None:
        return logits
    batch, vocab = logits.shape
    out_counts = _token_counts(meta.output_token_ids, vocab, logits.device)
    if rep is not None:
        assert meta.prompt_token_ids is not None
        seen = (_token_counts(meta.prompt_token_ids, vocab, logits.device) > 0) | (out_counts > 0)
        penalty = torch.where(seen, rep.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if freq is not None:
        logits = logits - freq.unsqueeze(1) * out_counts.to(logits.dtype)
    if pres is not None:
        logits = logits - pres.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Mask the stop ids of rows that have not reached ``min_tokens`` yet."""
    if not meta.min_tokens_stop_ids:
        return logits
    pairs = [(row, tok) for row, ids in meta.min_tokens_stop_ids.items() for tok in ids]
    index = _to_device(pairs, torch.int64, logits.device).t()
    return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask everything outside the top-k, then outside the top-p nucleus, to -inf.

    Top-p keeps the smallest set of most likely tokens whose cumulative probability reaches
    ``top_p`` (the most likely token always stays); it sees the top-k-renormalised distribution.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        # Ascending cumulative sum: a token is dropped when everything at or below it (in
        # probability) still leaves at least ``top_p`` of the mass to the tokens above it.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_noise(
    shape: torch.Size, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """q ~ Exponential(1) of ``shape``; seeded rows draw from their own generator only."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) < shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # exponential_ may return 0 on some backends; keep the division finite.
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


class Sampler(torch.nn.Module):
    """Turns a batch of logits into tokens (and logprobs) with no device → host transfer."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        logits = apply_penalties(logits, meta)
        logits = apply_min_tokens(logits, meta)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self.sample_random(logits, meta)
            if not meta.all_random:
                sampled = torch.where(meta.temperature == 0.0, logits.argmax(dim=-1), sampled)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs or 0)

    @staticmethod
    def sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Temperature, filters, then ``argmax(probs / q)`` — one exact draw per row."""
        probs = Sampler.random_probs(logits, meta)
        q = exponential_noise(probs.shape, meta.generators, probs.device)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def random_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: temperature, top-k/top-p, min-p."""
        temperature = torch.where(meta.temperature == 0.0, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        return logits.softmax(dim=-1)

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
    ) -> SamplerOutput:
        """Sampled token's logprob and rank, then the ``num_logprobs`` most likely tokens."""
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))
        ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs=torch.cat([sampled_lp, top_lp], dim=1),
            logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
            sampled_ranks=ranks,
        )
