"""Which proposed tokens a verify step keeps (Leviathan et al. 2023; Chen et al. 2023).

A request with guesses d_1..d_k is run on [last, d_1, .., d_k]; position j's logits give the
target distribution p_j of the token after d_1..d_j. General rule, for a proposal that drew d_j
from q_j: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
token from the residual norm(max(p_j - q_j, 0)) and stop; if all k are accepted, emit one more
from p_k. Every emitted token is then distributed exactly as the target model would sample it.

Point-mass proposals (n-gram, suffix: q_j = one-hot(d_j)) make this simple: accept with
probability p_j(d_j), and the residual is p_j with d_j removed. Drawing x_j ~ p_j and keeping
d_j when x_j == d_j is that same rule (P(x_j = d_j) = p_j(d_j); given x_j != d_j, x_j follows p_j
restricted to the other tokens). So a verify step samples every position with the ordinary
sampler (penalties aside, the same filters and seeds) and keeps the longest agreeing run:
greedy is the special case where x_j is the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_point_mass(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens emitted for one request: ``sampled`` holds the target's draw at each of the
    ``len(drafts) + 1`` positions; returns the agreeing run plus the first disagreeing draw
    (or the draw after the last guess when all agree)."""
    assert len(sampled) == len(drafts) + 1
    out: list[int] = []
    for d, x in zip(drafts, sampled, strict=False):
        out.append(x)
        if x != d:
            return out
    out.append(sampled[len(drafts)])
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The general rule for one request: ``target_probs`` [k + 1, V], ``draft_probs`` [k, V]
    (the distributions the guesses ``draft_tokens`` [k] were drawn from). Returns the emitted
    tokens (1 to k + 1). Used by proposers that draw from a distribution (a draft model)."""
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, device=target_probs.device)
    out: list[int] = []
    for j in range(k):
        d = int(draft_tokens[j])
        p, q = target_probs[j, d], draft_probs[j, d]
        if q <= 0 or u[j] * q <= p:  # accept with probability min(1, p / q)
            out.append(d)
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
