"""The host side of a step's inputs: each request's state kept across steps (token ids,
block-table row, sampling parameters), and the flat numpy arrays (ids, positions, KV slots,
query starts) of a decode or a general batch.

The states follow the scheduler's output: a new (or resumed) request arrives whole, a running
one brings only the blocks appended to its table, so a row is extended with the new tail rather
than rebuilt each step; the tokens a step samples are appended when it is collected. An input token that the step still running
sampled is not on the host yet: it is listed as a patch (``dst`` row <- ``src`` row of that
step's sampled ids) for the runner to apply on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.protocol import WireSamplingParams
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.worker.host_staging import HostStaging
from fulcrum.worker.logit_edits import LogitEdits, logit_edits
from fulcrum.worker.sampler import fused_sampling, plain_greedy


@dataclass
class ReqState:
    """What the runner keeps of one request across steps: its token ids as far as the host
    knows them (the prompt, then each sampled token once its step is collected), its block-table
    row, and how its tokens are sampled."""

    req_id: str
    index: int  # its place among the request's n sequences
    params: WireSamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output collected so far
    row: np.ndarray  # int32 [capacity] block table; entries past ``filled`` are 0
    filled: int
    plain_greedy: bool
    fused_sample: bool  # the sort-free sampler serves it (``sampler.fused_sampling``)
    generator: torch.Generator | None = None  # seeded sorting-sampler draws (made on first use)
    edits: LogitEdits | None = None  # logit_bias, allowed_token_ids (``worker/logit_edits.py``)
    lora_slot: int = 0  # its LoRA adapter (0: the base model)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def append_blocks(self, blocks: list[int]) -> None:
        n = self.filled + len(blocks)
        if n > self.row.shape[0]:
            self.row = np.concatenate([self.row, np.zeros(n, dtype=np.int32)])
        self.row[self.filled : n] = blocks
        self.filled = n


@dataclass
class GeneralBatch:
    """Prefill chunks and decodes of one step, flattened to ``total`` tokens."""

    ids: np.ndarray  # [total] int64
    positions: np.ndarray  # [total] int64
    slots: np.ndarray  # [total] int64 KV slot of each token
    qsl: np.ndarray  # [n + 1] int64 query start of each request
    seq_lens: np.ndarray  # [n] int64 context length after this step
    counts: np.ndarray  # [n] int64 tokens of each request in this step
    rows: list[int]  # requests whose last token is sampled
    dst: list[int]  # token rows to patch from the previous step's sampled ids ...
    src: list[int]  # ... at these rows of them
    table: torch.Tensor  # host block tables [n, width]

    @property
    def total(self) -> int:
        return int(self.qsl[-1])

    def pad(self, to: int) -> None:
        """Padding rows up to ``to`` tokens: id 0, position 0, KV slot -1 (nothing written)."""
        extra = to - self.ids.shape[0]
        if extra > 0:
            zeros = np.zeros(extra, np.int64)
            self.ids = np.concatenate([self.ids, zeros])
            self.positions = np.concatenate([self.positions, zeros])
            self.slots = np.concatenate([self.slots, np.full(extra, -1, np.int64)])


class InputBuilder:
    def __init__(self, max_blocks: int, max_num_seqs: int, staging: HostStaging) -> None:
        self.max_blocks = max_blocks
        self.max_num_seqs = max_num_seqs
        self.staging = staging
        self._states: dict[str, ReqState] = {}

    def update_states(self, out: SchedulerOutput) -> list[ReqState]:
        """Apply the step's changes; the scheduled requests' states in batch order."""
        held = self._states
        for req_id in out.finished_req_ids:
            held.pop(req_id, None)
        cached = out.scheduled_cached_reqs
        states: list[ReqState] = []
        offsets = cached.block_offsets or [None] * len(cached.req_ids)
        for req_id, blocks, offset in zip(cached.req_ids, cached.new_block_ids, offsets, strict=True):
            st = held[req_id]
            if offset is not None and offset < st.filled:  # the scheduler freed the tail
                st.filled = offset
            if blocks:
                st.append_blocks(blocks)
            states.append(st)
        for new in out.scheduled_new_reqs:
            p = new.sampling_params
            row = np.zeros(max(self.max_blocks, len(new.block_ids)), dtype=np.int32)
            st = ReqState(
                new.req_id, new.index, p, new.prompt_token_ids,
                new.prompt_token_ids + new.output_token_ids, row, 0,
                plain_greedy(p), fused_sampling(p), edits=logit_edits(p), lora_slot=new.lora_slot,
            )
            st.append_blocks(new.block_ids)
            old = held.get(new.req_id)
            if old is not None:  # resumed after preemption: its seeded draws continue
                st.generator = old.generator
            held[new.req_id] = st
            states.append(st)
        return states

    def table(self, states: list[ReqState], width: int) -> torch.Tensor:
        """Block tables of the batch as a contiguous host tensor ``[n, width]``."""
        host = self.staging.get("table", len(states) * width, torch.int32)
        host = host.view(len(states), width)
        np.stack([st.row[:width] for st in states], out=host.numpy())
        return host

    @staticmethod
    def decode_batch(
        out: SchedulerOutput, states: list[ReqState], starts: list[int], prev_rows: dict[str, int]
    ) -> tuple[np.ndarray, np.ndarray, list, list] | None:
        """(input ids, positions, patch rows, their rows in the previous step's sampled ids) if
        every request computes exactly its one last token."""
        n = len(states)
        ids = np.zeros(n, dtype=np.int64)
        pos = np.fromiter(starts, np.int64, n)
        dst: list[int] = []
        src: list[int] = []
        steps = zip(states, out.num_scheduled_tokens, starts, out.samples, strict=True)
        for i, (st, k, s, smp) in enumerate(steps):
            if k != 1 or not smp:
                return None
            toks = st.token_ids
            if s < len(toks):
                ids[i] = toks[s]
            else:  # sampled by the step still running
                dst.append(i)
                src.append(prev_rows[st.req_id])
        return ids, pos, dst, src

    @staticmethod
    def verify_batch(
        out: SchedulerOutput, states: list[ReqState], starts: list[int]
    ) -> tuple[np.ndarray, np.ndarray, list[ReqState], list[list[int]]] | None:
        """A verify step as decode rows, if every request computes its last token plus its
        guesses (none a prompt chunk, every input on the host): (input ids, positions, each
        row's request, each request's guesses). A request's rows are its last token then each
        guess; row ``i`` attends to the context up to itself, as a decode row would, since
        every row's KV is written before any row attends."""
        spec = out.scheduled_spec_decode_tokens
        ids: list[int] = []
        pos: list[int] = []
        row_states: list[ReqState] = []
        drafts: list[list[int]] = []
        steps = zip(states, out.num_scheduled_tokens, starts, out.samples, strict=True)
        for st, k, s, smp in steps:
            d = spec.get(st.req_id, [])
            if not smp or k != len(d) + 1 or s >= len(st.token_ids):
                return None
            ids.append(st.token_ids[s])
            ids += d
            pos += range(s, s + k)
            row_states += [st] * k
            drafts.append(d)
        return np.array(ids, np.int64), np.array(pos, np.int64), row_states, drafts

    def general_batch(
        self,
        out: SchedulerOutput,
        states: list[ReqState],
        starts_list: list[int],
        prev_rows: dict[str, int],
        block_size: int,
    ) -> GeneralBatch:
        n = len(states)
        starts = np.fromiter(starts_list, np.int64, n)
        counts = np.fromiter(out.num_scheduled_tokens, np.int64, n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        req_of_tok = np.repeat(np.arange(n), counts)
        positions = np.arange(total, dtype=np.int64) - qsl[req_of_tok] + starts[req_of_tok]
        ids = np.zeros(total, dtype=np.int64)
        dst: list[int] = []
        src: list[int] = []
        for i, (st, k) in enumerate(zip(states, out.num_scheduled_tokens, strict=True)):
            s, a, toks = int(starts[i]), int(qsl[i]), st.token_ids
            known = min(k, len(toks) - s)
            ids[a : a + known] = toks[s : s + known]
            drafts = out.scheduled_spec_decode_tokens.get(st.req_id)
            if drafts:  # a verify step: the last token, then the guesses
                ids[a + known : a + k] = drafts
            elif known < k:  # the last input was sampled by the step still running
                assert known == k - 1, "at most one pending token per request"
                dst.append(a + k - 1)
                src.append(prev_rows[st.req_id])
        rows = [i for i, smp in enumerate(out.samples) if smp]
        table = self.table(states, max(st.filled for st in states))
        bs = block_size
        slots = table.numpy()[req_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        return GeneralBatch(
            ids, positions, slots, qsl, starts + counts, counts, rows, dst, src, table
        )
