"""Whether and how far a running request speculates this step."""

from __future__ import annotations

from fulcrum.config import SpeculativeConfig
from fulcrum.request import Request
from fulcrum.spec_decode.proposer import Proposer


def propose_for(
    proposer: Proposer,
    config: SpeculativeConfig,
    req: Request,
    budget: int,
    num_running: int,
    max_model_len: int,
) -> list[int]:
    """Guesses for a decoding request, within the step's token budget, its max_tokens and the
    model's length. None in a batch larger than ``disable_by_batch_size``, and none where the
    sampler needs each position's own history (penalties; min_tokens not reached yet; a bad
    word of several tokens), which a
    verify step's rows, all sampled with the history before the step, would not have; none for
    a request under a grammar, whose mask is filled for one position per step."""
    if req.num_pending or not req.prefill_done or num_running > config.disable_by_batch_size:
        return []
    if req.matcher is not None:
        return []
    sp = req.params
    if not req.overlap_safe and (
        sp.repetition_penalty != 1.0
        or sp.presence_penalty != 0.0
        or sp.frequency_penalty != 0.0
        or req.num_output_tokens < sp.min_tokens
        or any(len(w) > 1 for w in sp.bad_words_token_ids)
    ):
        return []
    k = min(
        config.num_speculative_tokens,
        budget - 1,
        sp.max_tokens - req.num_output_tokens - 1,
        max_model_len - req.num_tokens - 1,
    )
    if k < 1:
        return []
    return proposer.propose(req.key, req.all_token_ids, k)[:k]
