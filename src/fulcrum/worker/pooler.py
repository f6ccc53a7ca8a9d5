"""An embedding model's pooling (``runner="pooling"``): each prompt's hidden states after the
decoder's final norm, gathered over the prompt's chunks into one float32 vector.

A prompt may take several steps (chunked prefill): ``mean`` keeps a running sum per request and
``cls`` the first position's row until the step that computes the prompt's last token, which
hands the vector over (``last`` needs that step only). Those two compute every prompt position
themselves (``PoolerConfig.whole_prompt``: no prefix-cache hits), so a chunk at position 0
starts a request's sum afresh, after a preemption too. The vector stays unnormalized here: a
request's ``dimensions`` cut comes before the normalization, where the output is built.
"""

from __future__ import annotations

import numpy as np
import torch

from fulcrum.config import PoolerConfig
from fulcrum.worker.input_batch import ReqState


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # req_id -> sum (mean) or first row (cls)

    def step(
        self,
        hidden: torch.Tensor,  # the step's hidden states, one row per scheduled token
        qsl: np.ndarray,  # [n + 1] each request's first row
        states: list[ReqState],
        starts: list[int],  # each request's first position this step
    ) -> list[tuple[str, torch.Tensor]]:
        """``(req_id, vector)`` for each request whose prompt's last token is in this step."""
        kind = self.config.pooling_type
        done = []
        for i, st in enumerate(states):
            a, n, s = int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(starts[i])
            prompt = len(st.prompt_token_ids)
            end = min(s + n, prompt)  # a decode row (s >= prompt) pools nothing
            if end <= s:
                continue
            rows = hidden[a : a + end - s]
            if kind == "mean":
                part = rows.float().sum(0)
                if s > 0:
                    part = part + self._partial.pop(st.req_id)
                self._partial[st.req_id] = part
            elif kind == "cls" and s == 0:
                self._partial[st.req_id] = rows[0].to(torch.float32, copy=True)
            if end < prompt:
                continue
            if kind == "last":
                # a copy: the hidden states may be a graph's static output, which the next
                # step overwrites before this one is collected
                vec = rows[-1].to(torch.float32, copy=True)
            elif kind == "mean":
                vec = self._partial.pop(st.req_id) / prompt
            else:
                vec = self._partial.pop(st.req_id)
            done.append((st.req_id, vec))
        return done

    def forget(self, req_ids) -> None:
        """Finished or aborted requests: drop what a prompt cut short left."""
        for rid in req_ids:
            self._partial.pop(rid, None)


def to_host(found: list[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes]]:
    """The step's vectors as float32 bytes (one copy to the host for the whole step)."""
    if not found:
        return []
    host = torch.stack([v for _, v in found]).cpu().numpy()
    return [(rid, host[i].tobytes()) for i, (rid, _) in enumerate(found)]
