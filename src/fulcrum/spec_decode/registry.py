"""Proposers by ``SpeculativeConfig.method``."""

from __future__ import annotations

from fulcrum.config import SpeculativeConfig
from fulcrum.spec_decode.draft_model import DraftModelProposer
from fulcrum.spec_decode.ngram import NgramProposer
from fulcrum.spec_decode.proposer import Proposer
from fulcrum.spec_decode.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    if config.method == "draft_model":
        return DraftModelProposer(config.num_speculative_tokens)
    raise ValueError(f"speculative_config.method: no proposer for {config.method!r}.")
