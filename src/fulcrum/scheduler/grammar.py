"""The scheduler's grammar bookkeeping: a structured request's matcher once its compile is done,
the compiles an idle loop waits on, the step's bitmask rows, and one batch advance of the
matchers of rows with one new token."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fulcrum.request import Request
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.structured.manager import StructuredOutputManager
from fulcrum.structured.thinking import GatedMatcher

logger = logging.getLogger(__name__)


def attach_matcher(req: Request) -> BaseException | bool:
    """Whether a structured request may run: True once its grammar compiled (its matcher made
    here, on first use), False while it compiles, the compile's exception if it failed (the
    frontend validated the constraint, so that is an engine fault: the caller aborts it)."""
    if req.grammar is None or req.matcher is not None:
        return True
    if not req.grammar.done():
        return False
    err = req.grammar.exception()
    if err is not None:
        return err
    req.matcher = req.grammar.result().new_matcher()
    gate = req.params.structured_outputs.thinking
    if gate is not None:  # a reasoning model: the grammar constrains only the answer
        req.matcher = GatedMatcher(req.matcher, gate)
    for tok in req.output_token_ids:  # resumed with output (cannot happen today; cheap)
        req.matcher.accept_token(tok)
    return True


def blocking_grammars(waiting: Iterable[Request]) -> list:
    """The compiles every waiting request waits on (empty if one of them could run); the caller
    asks only when nothing runs."""
    waiting = list(waiting)
    if not waiting or any(r.grammar is None or r.grammar.done() for r in waiting):
        return []
    return list({id(r.grammar): r.grammar for r in waiting}.values())


def sampled_matchers(reqs: list[Request], out: SchedulerOutput) -> list:
    """Each sampled row's matcher in row order (None: unconstrained, or its request ended)."""
    return [
        r.matcher if not r.status.finished else None
        for r, s in zip(reqs, out.samples, strict=True)
        if s
    ]


def advance_matchers(
    structured: StructuredOutputManager | None,
    reqs: list[Request],
    out: SchedulerOutput,
    sampled: list[int],
    num_tokens: list[int] | None,
) -> set[int]:
    """Advance together the grammars of rows with one new token (every row of a plain decode
    step); ``Scheduler.update`` then skips their per-token advance. Rows with several tokens
    (verify steps) advance token by token there, where a stop may cut the run short. The ids of
    the advanced requests are returned."""
    if structured is None or not any(r.matcher is not None for r in reqs):
        return set()  # the common step: a cheap scan, no per-row bookkeeping
    matchers, tokens, keys = [], [], []
    k = row = 0
    for req, samples in zip(reqs, out.samples, strict=True):
        if not samples:
            continue
        c = num_tokens[row] if num_tokens is not None else 1
        row += 1
        if c == 1 and req.matcher is not None and not req.status.finished:
            matchers.append(req.matcher)
            tokens.append(sampled[k])
            keys.append(req)
        k += c
    if not matchers:
        return set()
    for req, tok, ok in zip(keys, tokens, structured.accept(matchers, tokens), strict=True):
        if not ok:
            logger.warning("request %s: token %d rejected by its grammar", req.key, tok)
    return {id(r) for r in keys}
