"""Speculative decoding: proposers that guess a request's next tokens on the host (``ngram``,
``suffix``), and the rule that keeps the guesses the target model agrees with."""

from fulcrum.spec_decode.proposer import Proposer
from fulcrum.spec_decode.registry import make_proposer
from fulcrum.spec_decode.rejection import accept_point_mass, rejection_sample

__all__ = ["Proposer", "accept_point_mass", "make_proposer", "rejection_sample"]
