"""Log-probabilities of a request's own prompt tokens (``SamplingParams.prompt_logprobs``): what
scoring a text needs (evaluation harnesses send a prompt with ``echo`` and ``logprobs`` and read
back each prompt token's logprob).

A prefill chunk's hidden rows already predict the prompt's next tokens: the row of position p
gives the distribution of token p + 1. For each requesting row range of a step, the LM head runs
on those rows (a few hundred at a time: a chunk of 8,192 rows times a 128k vocabulary would be
4 GiB of fp32 logits), and the logprob and rank of the actual next prompt token, plus the top-k,
are read back. The row of the prompt's last position predicts the first output token; the
sampler covers it. Logprobs are of the raw model distribution (no temperature or filters), as
the sampled tokens' ``logprobs`` are.
"""

from __future__ import annotations

import numpy as np
import torch

from fulcrum.protocol import Logprobs
from fulcrum.worker.input_batch import ReqState

ROWS_PER_PASS = 256


def chunk_prompt_logprobs(
    compute_logits,  # hidden [rows, H] -> logits [rows, V]
    hidden: torch.Tensor,  # the step's hidden states, one row per scheduled token
    qsl: np.ndarray,  # [n + 1] each request's first row
    states: list[ReqState],
    starts: list[int],  # each request's first position this step
) -> list[tuple[str, int, list[Logprobs]]]:
    """``(req_id, first position, logprobs of the prompt tokens after it)`` for each request of
    the step that asks for prompt logprobs and computes prompt positions whose next token is a
    prompt token."""
    found = []
    for i, st in enumerate(states):
        k = st.params.prompt_logprobs
        if k is None:
            continue
        s, n = int(starts[i]), int(qsl[i + 1] - qsl[i])
        end = min(s + n, len(st.prompt_token_ids) - 1)
        if end <= s:
            continue
        rows = hidden[int(qsl[i]) : int(qsl[i]) + end - s]
        targets = torch.tensor(st.prompt_token_ids[s + 1 : end + 1], device=hidden.device)
        found.append((st.req_id, s, _logprobs(compute_logits, rows, targets, k)))
    return found


def _logprobs(compute_logits, rows: torch.Tensor, targets: torch.Tensor, k: int) -> list[Logprobs]:
    out: list[Logprobs] = []
    for a in range(0, rows.shape[0], ROWS_PER_PASS):
        logp = torch.log_softmax(compute_logits(rows[a : a + ROWS_PER_PASS]).float(), dim=-1)
        tgt = targets[a : a + ROWS_PER_PASS, None]
        tok = logp.gather(1, tgt)
        rank = (logp > tok).sum(1) + 1
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], tgt[:, :0])
        for lp, r, ids, vals in zip(tok[:, 0].tolist(), rank.tolist(), top_i.tolist(),
                                    top_v.tolist(), strict=True):  # fmt: skip
            out.append(Logprobs(lp, r, ids, vals))
    return out
