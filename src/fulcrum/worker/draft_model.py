"""The draft model of ``speculative_config.method == "draft_model"``: a smaller model with the
target's vocabulary, run in the same worker just before the target's forward, k steps ahead.

Its KV cache is its own tensors, indexed by the target's block ids: a request's block table,
the scheduler's allocation, prefix sharing, preemption and the rollback of rejected guesses
serve both models, and the pool is sized for the two per block (``ModelRunner.bytes_per_block``).
The draft computes every token the target computes, in the same step (prefill chunks, decodes,
the tokens after a prefix hit, a preempted request's recompute), so a block the prefix cache
holds has the draft's KV too::

    step:   target computes [s, s + n) of a request, its last k of them guesses
    draft:  pass 1   tokens [c, L) (L = s + n - k; c <= s: a run of accepted guesses leaves the
                     last guess uncomputed), logits at L - 1  ->  q_1, d_1
            pass j   d_{j-1} at position L + j - 2            ->  q_j, d_j      (j = 2 .. k)
    verify: the target's rows at L - 1 .. L + k - 1; ``a`` guesses kept
    after:  the draft has KV through L + min(a, k - 1) - 1 (d_k itself was never fed)

Passes 2..k run every speculating request (bucketed like decode steps): a request with fewer
guesses rides along with its KV write off (slot -1) and its outputs ignored.
"""

from __future__ import annotations

import numpy as np
import torch

from fulcrum.attention.backend import AttentionMetadata
from fulcrum.attention.selector import get_backend_cls
from fulcrum.config import EngineConfig, KernelConfig
from fulcrum.model.loader.weights import load_model
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.worker.cuda_graph import DecodeGraphs
from fulcrum.worker.draft_verify import DraftGuesses, draw, row_probs
from fulcrum.worker.host_staging import HostStaging
from fulcrum.worker.input_batch import ReqState
from fulcrum.worker.sampler import greedy_argmax
from fulcrum.worker.step_sampling import StepSampler


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        kv_dtype: torch.dtype,
        max_blocks: int,
        kernel_config: KernelConfig,
    ) -> None:
        mc = config.draft_model_config
        assert mc is not None
        self.mc = mc
        self.device = dev = config.device
        self.kv_dtype = kv_dtype
        self.block_size = config.cache_config.block_size
        self.max_blocks = max_blocks
        backend_cls = get_backend_cls(config.attention_backend, dev)
        heads = mc.hf_config.num_attention_heads
        self.attn_backend = backend_cls(
            heads, mc.num_kv_heads, mc.head_dim, mc.head_dim**-0.5, kernel_config=kernel_config
        )
        self.model, self.load_time = load_model(mc, self.attn_backend, dev, kernel_config)
        self.kernel_config = kernel_config
        self.kv_caches: list[torch.Tensor] = []
        self.staging = HostStaging(dev)
        self.computed: dict[str, int] = {}  # tokens of each request with the draft's KV
        self._verifying: dict[str, tuple[int, int]] = {}  # req -> (L, k) of the step in flight
        # One-token-per-request passes replay these (``worker/draft_graphs.py`` captures them).
        self.graphs: DecodeGraphs | None = None
        self._graph_event: torch.cuda.Event | None = None

    @property
    def bytes_per_block(self) -> int:
        mc = self.mc
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.mc
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(mc.num_layers)
        ]

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self,
        out: SchedulerOutput,
        states: list[ReqState],
        starts: list[int],
        sampling: StepSampler,
    ) -> DraftGuesses | None:
        """Compute the step's tokens into the draft's KV and, for each request with guesses
        scheduled, draw them; None when the step has none."""
        self.staging.wait()
        self.forget(out.finished_req_ids)
        for new in out.scheduled_new_reqs:  # first scheduled, or recomputed after preemption
            self.computed[new.req_id] = new.num_computed_tokens
        spec = out.scheduled_spec_decode_tokens
        chunks: list[np.ndarray] = []
        firsts: list[int] = []
        ends: list[int] = []
        sample_rows: list[int] = []
        spec_states: list[ReqState] = []
        num_guesses: list[int] = []
        spec_ends: list[int] = []
        total = 0
        for st, n, s in zip(states, out.num_scheduled_tokens, starts, strict=True):
            k = len(spec.get(st.req_id, ()))
            end = s + n - k
            first = min(self.computed.get(st.req_id, s), s)
            assert end <= len(st.token_ids), "speculation runs one step at a time"
            chunks.append(np.asarray(st.token_ids[first:end], dtype=np.int64))
            firsts.append(first)
            ends.append(end)
            total += end - first
            self.computed[st.req_id] = end
            if k:
                sample_rows.append(total - 1)
                spec_states.append(st)
                spec_ends.append(end)
                num_guesses.append(k)
        positions = np.concatenate(
            [np.arange(f, e, dtype=np.int64) for f, e in zip(firsts, ends, strict=True)]
        )
        qlen = np.asarray(ends, dtype=np.int64) - np.asarray(firsts, dtype=np.int64)
        if not spec_states:
            self._logits("p1", states, np.concatenate(chunks), positions, qlen, None, None)
            self.staging.fence()
            return None
        rows = np.asarray(sample_rows, dtype=np.int64)
        logits = self._logits("p1", states, np.concatenate(chunks), positions, qlen, None, rows)
        meta = sampling.metadata(spec_states)
        probs0 = row_probs(logits, meta)
        n_spec, k_max = len(spec_states), max(num_guesses)
        tokens = torch.zeros(n_spec, k_max, dtype=torch.int64, device=self.device)
        probs = probs0.new_empty(n_spec, k_max, probs0.shape[1])
        tokens[:, 0] = draw(probs0, meta.generators)
        probs[:, 0] = probs0
        last = np.asarray(spec_ends, dtype=np.int64)
        ks = np.asarray(num_guesses, dtype=np.int64)
        ones = np.ones(n_spec, dtype=np.int64)
        for j in range(1, k_max):
            active = j < ks
            pos = np.where(active, last + j - 1, last + ks - 1)
            ids = tokens[:, j - 1].contiguous()
            logits = self._logits(f"p{j + 1}", spec_states, ids, pos, ones, active, None)
            q = row_probs(logits, meta)
            tokens[:, j] = draw(q, meta.generators)
            probs[:, j] = q
        self.staging.fence()
        self._verifying = {
            st.req_id: (int(e), int(k)) for st, e, k in zip(spec_states, last, ks, strict=True)
        }
        return DraftGuesses(tokens, probs, num_guesses)

    def accepted(self, emitted: dict[str, int]) -> None:
        """A verify step's tokens emitted per request (guesses kept + 1): the draft's KV is
        valid through the kept guesses, except the last guess, which it never computed."""
        for rid, (end, k) in self._verifying.items():
            if rid in emitted and rid in self.computed:
                self.computed[rid] = end + min(emitted[rid] - 1, k - 1)
        self._verifying = {}

    def forget(self, req_ids: list[str]) -> None:
        """Finished or aborted requests (also those of steps that ran nothing)."""
        for rid in req_ids:
            self.computed.pop(rid, None)

    def _logits(
        self,
        tag: str,
        states: list[ReqState],
        ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,  # [tokens]
        qlen: np.ndarray,  # [requests] tokens of each
        write: np.ndarray | None,  # [tokens] whose KV is written (None: all)
        rows: np.ndarray | None,  # token rows whose logits are wanted (None: every row)
    ) -> torch.Tensor:
        """One forward of the draft over a flattened batch (each request's tokens end its
        context): a decode graph's replay when every request has one token, else eager."""
        bs, st = self.block_size, self.staging
        width = max(s.filled for s in states)
        table = np.stack([s.row[:width] for s in states])
        req_of_tok = np.repeat(np.arange(len(states)), qlen)
        slots = table[req_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        if write is not None:
            slots = np.where(write, slots, -1)
        n = len(states)
        g = self.graphs
        if g is not None and len(positions) == n and g.bucket(n) is not None:
            if self._graph_event is not None:  # the last staging's host buffers were read
                self._graph_event.synchronize()
            host_ids = ids if isinstance(ids, np.ndarray) else np.zeros(n, dtype=np.int64)
            b = g.stage(host_ids, positions, slots, torch.from_numpy(table))
            if isinstance(ids, torch.Tensor):
                g.tokens[0, :n].copy_(ids)
            if self.device.type == "cuda":
                self._graph_event = torch.cuda.Event()
                self._graph_event.record()
            logits, _ = g.replay(b, n)
            return logits if rows is None else logits[torch.as_tensor(rows, device=self.device)]
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlen, out=qsl[1:])
        seq = positions[qsl[1:] - 1] + 1
        meta = AttentionMetadata.build(
            query_start_loc=st.put(tag + "qsl", qsl, torch.int32),
            seq_lens=st.put(tag + "seq", seq, torch.int32),
            block_tables=st.put(tag + "table", table, torch.int32),
            slot_mapping=st.put(tag + "slots", slots, torch.int64),
            max_query_len=int(qlen.max()),
            max_seq_len=int(seq.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq.tolist(),
        )
        if isinstance(ids, np.ndarray):
            ids = st.put(tag + "ids", ids, torch.int64)
        pos_dev = st.put(tag + "pos", positions, torch.int64)
        hidden = self.model(ids, pos_dev, self.kv_caches, meta)
        if rows is None:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[st.put(tag + "rows", rows, torch.int64)])

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode graphs' forward (``worker/cuda_graph.py``): logits and greedy ids."""
        logits = self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))
        return logits, greedy_argmax(logits, out, self.kernel_config)
