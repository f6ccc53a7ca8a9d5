"""A step's logits to sampled ids on their way to the host, without waiting on the device::

    logits ─► (grammar bitmask, logit_bias, allowed_token_ids)
           ─► the decode graph sampled every row itself (``DecodeGraphs.sample_in_graph``):
              its ids
           ─► every row plain greedy: argmax (the decode graph's own, when it ran one)
           ─► every row served by the sort-free kernels (``sampler.fused_sampling``: no
              penalties, logprobs or min_tokens; not top-k with top-p), on CUDA, where
              ``KernelConfig.fused_sampler`` is on: ``sample_fused``
           ─► otherwise: the sorting ``Sampler`` (penalties, filters, seeds, logprobs)
           ─► asynchronous device → host copy of the ids (plus logprobs when asked)

The runner keeps the sampled ids on the device: the next step's inputs are patched from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.config import KernelConfig
from fulcrum.kernels.dispatch import use_triton
from fulcrum.protocol import Logprobs, WireSamplingParams
from fulcrum.structured.apply import apply_bitmask
from fulcrum.worker.input_batch import ReqState
from fulcrum.worker.logit_edits import apply_logit_edits
from fulcrum.worker.sampler import Sampler, SamplingMetadata, greedy_argmax, sample_fused


@dataclass
class StepHandle:
    """A launched step: its sampled ids (and logprobs) on their way to host memory."""

    sampled: torch.Tensor  # host tensor [num sampled rows]
    event: torch.cuda.Event | None  # set once the copies are done (None: already done)
    states: list[ReqState]  # the sampled rows' requests
    logprobs: list[torch.Tensor] | None = None  # host (logprobs, ids, ranks)
    # A verify step: each sampling request's guesses; its rows (one per guess, plus one) in
    # ``sampled`` and ``states`` are consecutive. ``collect`` keeps the agreeing run.
    drafts: list[list[int]] | None = None
    num_tokens: list[int] | None = None  # set by collect: tokens kept per request
    counts: torch.Tensor | None = None  # a draft model's verify step: tokens emitted per request
    # ``prompt_logprobs.chunk_prompt_logprobs`` of the step's prefill chunks, computed at launch
    prompt_logprobs: list | None = None
    # ``pooler.Pooler.step``'s vectors (device), float32 bytes once collected
    pooled: list | None = None


class StepSampler:
    """Picks the sampler for a step's rows, launches it, and collects what it sampled."""

    def __init__(self, device: torch.device, vocab_size: int, kernel_config: KernelConfig) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.kernel_config = kernel_config
        self.sampler = Sampler()

    def sample(
        self,
        logits: torch.Tensor | None,
        states: list[ReqState],
        positions: Sequence[int],
        greedy: torch.Tensor | None = None,
        bitmask: np.ndarray | None = None,
        graph_sampled: bool = False,
    ) -> tuple[StepHandle, torch.Tensor | None]:
        """The step's handle, and its sampled ids on the device (None: nothing sampled).
        ``positions``: each row's sampled token's position; ``greedy``: a decode graph's ids,
        its argmax of every row, or with ``graph_sampled`` every row's draw; ``bitmask``:
        structured output's allowed tokens per row, applied to the logits first (then each row's
        ``logit_bias`` and ``allowed_token_ids``)."""
        if logits is None:  # prefill chunks only
            return StepHandle(torch.empty(0, dtype=torch.int64), None, []), None
        if bitmask is not None:
            logits = apply_bitmask(logits, bitmask)
            greedy = None  # a decode graph's argmax saw the unmasked logits
        if any(st.edits is not None for st in states):
            assert not graph_sampled, "a decode graph drew rows whose logits are edited"
            logits = apply_logit_edits(
                logits, [st.edits for st in states], [st.output_token_ids for st in states]
            )
            greedy = None  # nor the edits
        extra: list[torch.Tensor] = []
        kc = self.kernel_config
        if graph_sampled and greedy is not None:
            sampled = greedy
        elif all(st.plain_greedy for st in states):
            sampled = greedy if greedy is not None else greedy_argmax(logits, None, kc)
        elif kc.fused_sampler and use_triton(logits, kc) and all(st.fused_sample for st in states):
            params = [st.params for st in states]
            sampled = sample_fused(logits, params, [st.index for st in states], positions)
        else:
            result = self.sampler(logits.float(), self.metadata(states))
            sampled = result.sampled_token_ids.to(torch.int64)
            if result.logprobs is not None:
                extra = [result.logprobs, result.logprob_token_ids, result.sampled_ranks]
        host, event = self.to_host(sampled, *extra)
        return StepHandle(host[0], event, states, host[1:] or None), sampled

    def collect(self, h: StepHandle) -> tuple[list[int], list[Logprobs | None] | None]:
        """Wait for a launched step; its sampled ids (and logprobs) as Python lists."""
        if h.event is not None:
            h.event.synchronize()
        sampled = h.sampled.tolist()
        if h.logprobs is None:
            return sampled, None
        lps, ids, ranks = (t.tolist() for t in h.logprobs)
        return sampled, self._logprobs(h.states, lps, ids, ranks)

    def warm(self, logits: torch.Tensor) -> None:
        """Launch the sort-free sampler on ``logits``, so that its kernels compile at start-up
        rather than at the first sampled request."""
        if self.kernel_config.fused_sampler and use_triton(logits, self.kernel_config):
            n = len(logits)
            sample_fused(logits, [WireSamplingParams(top_p=0.9)] * n, [0] * n, [0] * n)

    def to_host(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Start copying device tensors to (pinned) host memory; the event marks them done."""
        if self.device.type != "cuda":  # copies too: graph outputs are overwritten by the next step
            return [t.clone() for t in tensors], None
        outs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for o, t in zip(outs, tensors, strict=True):
            o.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return outs, event

    def metadata(self, states: list[ReqState]) -> SamplingMetadata:
        for st in states:
            if st.params.seed is not None and st.generator is None:
                st.generator = torch.Generator(device=self.device).manual_seed(
                    st.params.seed + st.index
                )
        return SamplingMetadata.build(
            [st.params for st in states],
            [st.generator for st in states],
            [st.output_token_ids for st in states],
            [st.prompt_token_ids for st in states],
            self.vocab_size,
            self.device,
        )

    @staticmethod
    def _logprobs(
        states: list[ReqState], lps: list, ids: list, ranks: list
    ) -> list[Logprobs | None]:
        out: list[Logprobs | None] = []
        for i, st in enumerate(states):
            if st.params.logprobs is None:
                out.append(None)
                continue
            k = st.params.logprobs
            out.append(Logprobs(lps[i][0], ranks[i], ids[i][1 : k + 1], lps[i][1 : k + 1]))
        return out
