"""The host side of a step's inputs: each request's block-table row kept across steps, and the
flat numpy arrays (ids, positions, KV slots, query starts) of a decode or a general batch.

Block tables are mirrored per request in numpy rows that only grow: the KV manager appends
blocks to a request's table and gives a re-admitted request a new list, so a row is extended
with the new tail rather than rebuilt each step. An input token that the step still running
sampled is not on the host yet: it is listed as a patch (``dst`` row <- ``src`` row of that
step's sampled ids) for the runner to apply on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fulcrum.engine.protocol import WireSamplingParams
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.worker.host_staging import HostStaging
from fulcrum.worker.sampler import fused_sampling, plain_greedy


@dataclass
class ReqState:
    """Per-request state kept across steps: its block-table row and whether argmax suffices."""

    params: WireSamplingParams
    blocks: list[int]  # the KV manager's list (grows in place)
    row: np.ndarray  # int32 [capacity]; entries past ``filled`` are 0
    filled: int
    plain_greedy: bool
    fused_sample: bool  # the sort-free sampler serves it (``sampler.fused_sampling``)

    def sync(self, blocks: list[int]) -> None:
        n = len(blocks)
        if n > self.row.shape[0]:
            self.row = np.concatenate([self.row, np.zeros(n, dtype=np.int32)])
        self.row[self.filled : n] = blocks[self.filled :]
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

    def states(self, out: SchedulerOutput, block_tables: list[list[int]]) -> list[ReqState]:
        """Each scheduled request's state, its block-table row brought up to date."""
        states: list[ReqState] = []
        get = self._states.get
        for (r, _), blocks in zip(out.scheduled, block_tables, strict=True):
            st = get(r.key)
            if st is None or st.params is not r.params or st.blocks is not blocks:
                row = np.zeros(max(self.max_blocks, len(blocks)), dtype=np.int32)
                st = ReqState(
                    r.params, blocks, row, 0, plain_greedy(r.params), fused_sampling(r.params)
                )
                self._states[r.key] = st
            if len(blocks) != st.filled:
                st.sync(blocks)
            states.append(st)
        if len(self._states) > 2 * self.max_num_seqs + len(states):
            keep = {r.key for r, _ in out.scheduled}
            self._states = {k: v for k, v in self._states.items() if k in keep}
        return states

    def table(self, states: list[ReqState], width: int) -> torch.Tensor:
        """Block tables of the batch as a contiguous host tensor ``[n, width]``."""
        host = self.staging.get("table", len(states) * width, torch.int32)
        host = host.view(len(states), width)
        np.stack([st.row[:width] for st in states], out=host.numpy())
        return host

    @staticmethod
    def decode_batch(
        out: SchedulerOutput, prev_rows: dict[str, int]
    ) -> tuple[np.ndarray, np.ndarray, list, list] | None:
        """(input ids, positions, patch rows, their rows in the previous step's sampled ids) if
        every request computes exactly its one last token."""
        n = len(out.scheduled)
        ids = np.zeros(n, dtype=np.int64)
        pos = np.fromiter(out.starts, np.int64, n)
        dst: list[int] = []
        src: list[int] = []
        steps = zip(out.scheduled, out.starts, out.samples, strict=True)
        for i, ((r, k), s, smp) in enumerate(steps):
            if k != 1 or not smp:
                return None
            toks = r.all_token_ids
            if s < len(toks):
                ids[i] = toks[s]
            else:  # sampled by the step still running
                dst.append(i)
                src.append(prev_rows[r.key])
        return ids, pos, dst, src

    def general_batch(
        self,
        out: SchedulerOutput,
        states: list[ReqState],
        prev_rows: dict[str, int],
        block_size: int,
    ) -> GeneralBatch:
        n = len(out.scheduled)
        starts = np.fromiter(out.starts, np.int64, n)
        counts = np.fromiter((k for _, k in out.scheduled), np.int64, n)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        req_of_tok = np.repeat(np.arange(n), counts)
        positions = np.arange(total, dtype=np.int64) - qsl[req_of_tok] + starts[req_of_tok]
        ids = np.zeros(total, dtype=np.int64)
        dst: list[int] = []
        src: list[int] = []
        for i, (r, k) in enumerate(out.scheduled):
            s, a, toks = int(starts[i]), int(qsl[i]), r.all_token_ids
            known = min(k, len(toks) - s)
            ids[a : a + known] = toks[s : s + known]
            if known < k:  # the last input was sampled by the step still running
                assert known == k - 1, "at most one pending token per request"
                dst.append(a + k - 1)
                src.append(prev_rows[r.key])
        rows = [i for i, smp in enumerate(out.samples) if smp]
        table = self.table(states, max(st.filled for st in states))
        bs = block_size
        slots = table.numpy()[req_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        return GeneralBatch(
            ids, positions, slots, qsl, starts + counts, counts, rows, dst, src, table
        )
