"""The general acceptance rule (``rejection.py``) for a whole verify step at once, on the device.

Requests are rows of a padded layout: request r has ``num_guesses[r]`` guesses (0 .. K); its
guess j was drawn from ``draft_probs[r, j]`` and ``target_probs[r, j]`` is the target's
distribution at that position (``target_probs[r, num_guesses[r]]``: after the last guess)::

    accept[r, j] = u[r, j] * q_j(d_j) <= p_j(d_j)        (probability min(1, p / q))
    a[r]         = leading accepts                        (guesses kept)
    token a[r]   ~ max(p_a - q_a, 0)   if a < num_guesses  (the residual; q = 0 past the guesses,
                                                           so a full run draws from p)

A greedy row has one-hot p and q: it keeps guesses while they equal the target's argmax and then
emits that argmax, the point-mass rule. No host sync: every count stays on the device.
"""

from __future__ import annotations

import torch


def rejection_sample_batch(
    target_probs: torch.Tensor,  # [R, K + 1, V]
    draft_probs: torch.Tensor,  # [R, K, V] (rows past a request's guesses: anything)
    draft_tokens: torch.Tensor,  # [R, K] int64
    num_guesses: torch.Tensor,  # [R] int64
    uniform: torch.Tensor,  # [R, K] in (0, 1]
    noise: torch.Tensor,  # [R, V] Exponential(1), for the last token's draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's emitted tokens ``[R, K + 1]`` (the first ``counts[r]`` are real) and
    ``counts`` ``[R]`` (1 to ``num_guesses + 1``)."""
    r, k1, _ = target_probs.shape
    k = k1 - 1
    rows = torch.arange(r, device=target_probs.device)
    d = draft_tokens.unsqueeze(2)
    p_d = target_probs[:, :k].gather(2, d).squeeze(2)
    q_d = draft_probs.gather(2, d).squeeze(2)
    valid = torch.arange(k, device=d.device).unsqueeze(0) < num_guesses.unsqueeze(1)
    accept = (uniform * q_d <= p_d) & valid
    kept = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
    p_last = target_probs[rows, kept]
    rejected = (kept < num_guesses).unsqueeze(1)
    q_last = draft_probs[rows, kept.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_last)
    residual = torch.where(rejected, (p_last - q_last).clamp_min(0), p_last)
    # p == q at a rejected position cannot happen in exact arithmetic; rounding may leave no mass
    dist = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_last)
    last = (dist / noise).argmax(dim=1)  # a draw proportional to dist
    emitted = torch.cat([draft_tokens, draft_tokens.new_zeros(r, 1)], dim=1)
    emitted.scatter_(1, kept.unsqueeze(1), last.unsqueeze(1))
    return emitted, kept + 1
