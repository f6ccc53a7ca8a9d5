"""A draft model's verify step: the target's logits at every verify row and the draft's guesses
(with the distributions they were drawn from) to the emitted tokens, by the general rule
(``spec_decode/batch_rejection.py``), on the device.

The same processing makes both distributions: penalties and min_tokens (only rows of requests
that did not speculate use them: ``scheduler/speculation.py`` keeps the others plain), then a
greedy row's one-hot argmax, or a random row's temperature, top-k/top-p and min-p. Logprobs are
the raw model's at each emitted token, as the plain sampler reports them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.spec_decode.batch_rejection import rejection_sample_batch
from fulcrum.structured.apply import apply_bitmask
from fulcrum.worker.input_batch import ReqState
from fulcrum.worker.logit_edits import apply_logit_edits
from fulcrum.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_tokens,
    apply_penalties,
    exponential_noise,
)
from fulcrum.worker.step_sampling import StepHandle, StepSampler


@dataclass
class DraftGuesses:
    """The draft's guesses for the step's speculating requests, in batch order."""

    tokens: torch.Tensor  # [S, K] int64 (past a request's own count: padding)
    probs: torch.Tensor  # [S, K, V] float32, the distribution each guess was drawn from
    num_guesses: list[int]  # [S]

    def fill(self, ids: torch.Tensor, qsl: np.ndarray, batch_rows: list[int]) -> None:
        """Write the guesses into a verify step's input ids: request ``batch_rows[s]``'s
        guesses are the last ``num_guesses[s]`` of its query rows."""
        dst = np.concatenate(
            [
                np.arange(qsl[i + 1] - g, qsl[i + 1])
                for i, g in zip(batch_rows, self.num_guesses, strict=True)
            ]
        )
        k = self.tokens.shape[1]
        src = np.concatenate([s * k + np.arange(g) for s, g in enumerate(self.num_guesses)])
        dev = ids.device
        flat = self.tokens.reshape(-1).index_select(0, torch.as_tensor(src, device=dev))
        ids.index_copy_(0, torch.as_tensor(dst, device=dev), flat)


def row_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row's token is drawn from ``[N, V]`` float32."""
    logits = apply_min_tokens(apply_penalties(logits.float(), meta), meta)
    greedy = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
    if meta.all_greedy:
        return greedy
    probs = Sampler.random_probs(logits, meta)
    if meta.all_random:
        return probs
    return torch.where((meta.temperature == 0.0).unsqueeze(1), greedy, probs)


def draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs`` (seeded rows from their own generator)."""
    return (probs / exponential_noise(probs.shape, generators, probs.device)).argmax(dim=1)


def uniform(shape: tuple[int, int], generators: dict[int, torch.Generator], dev) -> torch.Tensor:
    """``[R, K]`` uniform in (0, 1]; seeded rows from their own generator."""
    u = torch.rand(shape, device=dev)
    for row, g in generators.items():
        u[row] = torch.rand(shape[1], generator=g, device=dev)
    return 1.0 - u


def verify_step(
    sampling: StepSampler,
    logits: torch.Tensor,  # [rows, V]: each request's 1 + guesses rows, consecutive
    rows_states: list[ReqState],
    num_guesses: list[int],  # per sampled request
    guesses: DraftGuesses,
    bitmask: np.ndarray | None = None,
) -> tuple[StepHandle, torch.Tensor]:
    """The step's handle (``counts``: tokens emitted per request) and the emitted token of each
    verify row on the device (rows past a request's count: don't care)."""
    dev = logits.device
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    # (a request whose bad words read its history makes no guesses: one row, its own output)
    logits = apply_logit_edits(
        logits, [st.edits for st in rows_states], [st.output_token_ids for st in rows_states]
    )
    meta = sampling.metadata(rows_states)
    n, k = len(num_guesses), max(num_guesses)
    starts = np.concatenate([[0], np.cumsum(np.asarray(num_guesses) + 1)[:-1]])
    req_states = [rows_states[s] for s in starts]
    flat = np.concatenate([r * (k + 1) + np.arange(g + 1) for r, g in enumerate(num_guesses)])
    flat_dev = torch.as_tensor(flat, device=dev)
    probs = row_probs(logits, meta)
    vocab = probs.shape[1]
    target = probs.new_zeros(n * (k + 1), vocab).index_copy_(0, flat_dev, probs)
    spec = torch.as_tensor([r for r, g in enumerate(num_guesses) if g], device=dev)
    tokens = torch.zeros(n, k, dtype=torch.int64, device=dev)
    tokens[spec] = guesses.tokens[:, :k]
    draft = probs.new_zeros(n, k, vocab)
    draft[spec] = guesses.probs[:, :k]
    gens = {r: st.generator for r, st in enumerate(req_states) if st.generator is not None}
    emitted, counts = rejection_sample_batch(
        target.view(n, k + 1, vocab),
        draft,
        tokens,
        torch.as_tensor(num_guesses, dtype=torch.int64, device=dev),
        uniform((n, k), gens, dev),
        exponential_noise((n, vocab), gens, dev),
    )
    sampled = emitted.view(-1).index_select(0, flat_dev)
    extra: list[torch.Tensor] = []
    if meta.max_num_logprobs is not None:
        raw = torch.log_softmax(logits.float(), dim=-1)
        lp = Sampler.gather_logprobs(raw, sampled, meta.max_num_logprobs)
        assert lp.logprobs is not None and lp.logprob_token_ids is not None
        assert lp.sampled_ranks is not None
        extra = [lp.logprobs, lp.logprob_token_ids, lp.sampled_ranks]
    host, event = sampling.to_host(sampled, counts, *extra)
    handle = StepHandle(host[0], event, rows_states, host[2:] or None, counts=host[1])
    return handle, sampled
