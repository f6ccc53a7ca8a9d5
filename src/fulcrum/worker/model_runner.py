"""ModelRunner: owns the model and the KV pool; turns a SchedulerOutput into sampled tokens.

A step is launched without waiting on the device and collected later (``execute_async`` then
``collect``, which waits once, for the sampled ids)::

    scheduled requests ─► numpy (ids, positions, slots, block table) in pinned host buffers
        │  an input token the previous step sampled is not on the host yet: it is patched in
        │  on the device from that step's sampled ids (asynchronous scheduling)
        ├─ pure decode, n <= largest bucket: copy into the static buffers, replay a CUDA graph
        ├─ prefill chunks / mixed, tokens <= piecewise_graph_max_tokens: replay the token
        │  bucket's segment graphs, attention eager between them (worker/piecewise_graph.py)
        └─ otherwise (larger steps, eager mode): async copies, eager forward
    logits ─► sampled ids, copied to the host asynchronously (worker/step_sampling.py: the
              argmax, the sort-free sampling kernels, or the sorting Sampler)

A verify step (speculative decoding) is a general step whose requests bring their guesses as
extra input tokens: logits are computed at the last token and at each guess, every position is
sampled as an ordinary row, and ``collect`` keeps the agreeing run (spec_decode/rejection.py
says why that is exact for n-gram and suffix guesses). When every request decodes, its rows
(last token, then each guess) replay the decode graph of their count, each row a decode row
with its own position and the request's block table; otherwise (a prompt chunk in the step, a
draft model's guesses drawn on the device) it runs eagerly or through the piecewise graphs like
any mixed step.

The host-side arrays (block-table rows kept per request, ids, positions, slots) are built in
``worker/input_batch.py``. Start-up (sizing the KV pool, compiling ahead, capturing the graphs)
is ``worker/startup.py``; it calls ``allocate_kv_cache`` and fills ``graphs``/``piecewise``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from fulcrum.attention.backend import AttentionMetadata
from fulcrum.attention.selector import get_backend_cls
from fulcrum.config import EngineConfig, KernelConfig
from fulcrum.envs import seed_primitive_caches
from fulcrum.kernels.dispatch import use_triton
from fulcrum.kv_cache.dtype import resolve_kv_cache_dtype
from fulcrum.lora.layers import LoRAContext, LoRASlots
from fulcrum.model.layers.linear import Linear
from fulcrum.model.layers.packed_cpu import pack_linear_weights
from fulcrum.model.loader.weights import load_model, tp_shard
from fulcrum.protocol import Logprobs
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.spec_decode.rejection import accept_point_mass
from fulcrum.worker.cuda_graph import DecodeGraphs
from fulcrum.worker.draft_model import DraftModel
from fulcrum.worker.draft_verify import DraftGuesses, verify_step
from fulcrum.worker.host_kv import HostKV
from fulcrum.worker.host_staging import HostStaging
from fulcrum.worker.input_batch import InputBuilder, ReqState
from fulcrum.worker.piecewise_graph import PiecewiseGraphs
from fulcrum.worker.pooler import Pooler, to_host
from fulcrum.worker.prompt_logprobs import chunk_prompt_logprobs
from fulcrum.worker.sampler import fused_params
from fulcrum.worker.step_sampling import StepHandle, StepSampler


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = config.device
        if self.device.type == "cpu":  # before the model's first oneDNN primitive
            seed_primitive_caches(config.kernel_config.cpu_primitive_cache)
        self.dtype = mc.dtype
        self.kv_dtype = resolve_kv_cache_dtype(config.cache_config.cache_dtype, mc.dtype)
        self.block_size = config.cache_config.block_size
        # This rank's heads under tensor parallelism (fewer KV heads than ranks: one each).
        tp = config.parallel_config.tensor_parallel_size
        self.num_heads = mc.hf_config.num_attention_heads // tp
        self.num_kv_heads = max(1, mc.num_kv_heads // tp)
        self.kernel_config = kc = config.kernel_config
        backend_cls = get_backend_cls(config.attention_backend, self.device)
        self.attn_backend = backend_cls(
            self.num_heads, self.num_kv_heads, mc.head_dim, mc.head_dim**-0.5, kernel_config=kc
        )
        torch.manual_seed(mc.seed)
        self.model, self.load_time = load_model(mc, self.attn_backend, self.device, kc)
        self.lora: LoRAContext | None = None  # adapters' rows of the step (lora_modules)
        self.lora_slots: LoRASlots | None = None
        if config.lora_config.enabled:
            from fulcrum.lora.adapter import load_adapter

            adapters = [load_adapter(n, p) for n, p in config.lora_config.adapters]
            sc = config.scheduler_config
            rows = max(sc.max_num_seqs, sc.max_num_batched_tokens)
            self.lora_slots = LoRASlots(
                self.model, config.lora_config, adapters, self.device, self.dtype, rows,
                shard=tp_shard(mc),
            )  # fmt: skip
            self.lora = self.lora_slots.ctx
        if kc.cpu_packed_linear:
            spec = config.speculative_config is not None  # verify steps of 2 to k + 1 rows
            pack_linear_weights(self.model, Linear, spec)
        self.vocab_size = mc.vocab_size
        # an embedding model's prompts pooled as they finish (runner "pooling")
        self.pooler = Pooler(mc.pooler_config) if mc.pooler_config is not None else None
        self._pooled: list | None = None  # the general step's vectors, for its handle
        self.sampling = StepSampler(self.device, self.vocab_size, kc)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.host_kv: HostKV | None = None  # host_kv_cache_memory's blocks
        self.num_host_blocks = 0
        sc = config.scheduler_config
        self.max_model_len = max(mc.max_model_len, sc.max_model_len)
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self._staging = HostStaging(self.device)
        self.inputs = InputBuilder(self.max_blocks, sc.max_num_seqs, self._staging)
        n_arange = max(sc.max_num_seqs, sc.max_num_batched_tokens) + 1
        self._arange = torch.arange(n_arange, dtype=torch.int32, device=self.device)
        self.graphs: DecodeGraphs | None = None
        # decode graphs with the adapters' path (``lora/layers.py``): steps with adapter rows
        self.lora_graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.use_cuda_graphs = False  # True once graphs are captured; benchmarks may toggle it
        # The last launched step's sampled ids (device) and each request's row in them.
        self._prev_sampled: torch.Tensor | None = None
        self._graph_ids: torch.Tensor | None = None  # greedy ids of the last graph replay
        self._graph_owner: DecodeGraphs | None = None  # the graphs that replayed it
        self._prev_rows: dict[str, int] = {}
        self.num_graph_verify_steps = 0  # verify steps replayed in a decode graph
        self.timings: dict[str, float] = {"weights_s": self.load_time}
        # bytes each kind of CUDA graph added to the reserved memory at capture (after the KV
        # pool was sized, so outside gpu_memory_utilization's profile)
        self.graph_memory: dict[str, int] = {}
        self.draft: DraftModel | None = None  # speculative_config.method "draft_model"
        if config.draft_model_config is not None:
            self.draft = DraftModel(config, self.kv_dtype, self.max_blocks, kc)
            self.timings["draft_weights_s"] = self.draft.load_time

    def load_lora(self, slot: int, name: str, path: str) -> None:
        """Write the PEFT adapter at ``path`` into adapter ``slot`` (ValueError naming the field
        if it cannot be served)."""
        from fulcrum.lora.adapter import load_adapter

        assert self.lora_slots is not None
        self.lora_slots.load(slot, load_adapter(name, path))

    def set_kernel_config(self, kc: KernelConfig) -> None:
        """Switch the kernels' settings of the loaded model: the layers, the attention backend,
        the sampler and the decode graphs' next capture take ``kc`` from their next call on.
        Graphs captured already keep the launches they captured (a benchmark that compares
        settings captures one graph per setting)."""
        self.kernel_config = kc
        self.config = dataclasses.replace(self.config, kernel_config=kc)
        self.model.set_kernel_config(kc)
        self.attn_backend.kernel_config = kc
        self.sampling.kernel_config = kc
        if self.graphs is not None:
            self.graphs.kernel_config = kc

    # -- KV cache -----------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        mc = self.config.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per_block = 2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * elem
        return per_block + (self.draft.bytes_per_block if self.draft is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The KV pool, one tensor per layer (start-up sizes it, then captures the graphs)."""
        mc = self.config.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        # Zeroed, not empty: the FP8 kernels read V a whole page at a time and weight the tokens
        # past a sequence's end by 0, which needs them finite.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(mc.num_layers)
        ]
        self.num_blocks = num_blocks
        if self.draft is not None:  # indexed by the same block ids
            self.draft.allocate_kv_cache(num_blocks)
        gib = self.config.cache_config.host_kv_cache_memory
        if gib:  # the prefix cache's host tier (worker/host_kv.py)
            per_block = self.kv_caches[0][:, 0].numel() * self.kv_caches[0].element_size()
            self.num_host_blocks = int(gib * 2**30) // (per_block * len(self.kv_caches))
            self.host_kv = HostKV(self.kv_caches, self.num_host_blocks)

    # -- one step -----------------------------------------------------------------------------

    def _patch(self, ids: torch.Tensor, dst: list[int], src: list[int]) -> None:
        """``ids[dst] = previous step's sampled[src]``, on the device."""
        if dst:
            idx = self._staging.put("patch", np.array([dst, src], dtype=np.int64), torch.int64)
            self._fill_sampled(ids, idx)

    def _fill_sampled(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``ids[rows[0]] = previous step's sampled[rows[1]]`` for device ``rows [2, k]``: one
        launch on CUDA (``kernels/scatter.py``), a gather and a scatter elsewhere."""
        assert self._prev_sampled is not None
        if use_triton(ids, self.kernel_config):
            from fulcrum.kernels.scatter import gather_scatter

            gather_scatter(ids, rows, self._prev_sampled)
        else:
            ids.index_copy_(0, rows[0], self._prev_sampled.index_select(0, rows[1]))

    def update_states(self, out: SchedulerOutput) -> None:
        """Take a step's changes to the requests without running it (an empty step still
        reports finished requests)."""
        self.inputs.update_states(out)
        if self.draft is not None:
            self.draft.forget(out.finished_req_ids)
        if self.pooler is not None:
            self.pooler.forget(out.finished_req_ids)

    @torch.inference_mode()
    def execute_async(
        self, out: SchedulerOutput, before_sample: Callable[[], None] | None = None
    ) -> StepHandle:
        """Launch one step; ``collect`` returns its sampled tokens. ``before_sample`` runs once
        the forward is launched and before sampling: structured output fills
        ``out.grammar_bitmask`` there, while the device computes the forward."""
        self._staging.wait()  # the previous step's host → device copies are done
        if out.kv_copies:  # blocks between the prefix cache's tiers, before anything reads them
            assert self.host_kv is not None
            self.host_kv.apply(out.kv_copies, self.kv_caches)
        states = self.inputs.update_states(out)
        if self.pooler is not None:
            self.pooler.forget(out.finished_req_ids)
        starts = out.num_computed_tokens
        guesses = None
        if self.draft is not None:  # the draft computes the step's tokens, then guesses
            guesses = self.draft.propose(out, states, starts, self.sampling)
        dec = self.inputs.decode_batch(out, states, starts, self._prev_rows)
        if dec is not None:
            logits, ids, drawn = self._decode_step(*dec, states, before_sample is None)
            if before_sample is not None:
                before_sample()
            return self._sample(logits, states, dec[1] + 1, ids, out.grammar_bitmask, drawn)
        if guesses is None and out.scheduled_spec_decode_tokens:
            handle = self._verify_in_decode_graph(out, states, starts, before_sample)
            if handle is not None:
                return handle
        logits, rows, ends, drafts, prompt_lps = self._general_step(out, states, starts, guesses)
        if before_sample is not None:
            before_sample()
        if drafts is None:
            handle = self._sample(logits, [states[i] for i in rows], ends, None, out.grammar_bitmask)
            handle.prompt_logprobs = prompt_lps
            handle.pooled, self._pooled = self._pooled, None
            return handle
        rows_states = [states[i] for i, d in zip(rows, drafts, strict=True) for _ in range(len(d) + 1)]
        positions = _verify_rows(ends, drafts)
        mask = _verify_mask(out.grammar_bitmask, drafts)
        if guesses is None:
            handle = self._sample(logits, rows_states, positions, None, mask)
        else:
            assert logits is not None
            nums = [len(d) for d in drafts]
            handle, self._prev_sampled = verify_step(
                self.sampling, logits, rows_states, nums, guesses, mask
            )
            self._prev_rows = {st.req_id: i for i, st in enumerate(rows_states)}
        handle.drafts = drafts
        handle.prompt_logprobs = prompt_lps
        return handle

    def _verify_in_decode_graph(
        self,
        out: SchedulerOutput,
        states: list[ReqState],
        starts: list[int],
        before_sample: Callable[[], None] | None,
    ) -> StepHandle | None:
        """A verify step of decoding requests (n-gram or suffix guesses) replayed in the decode
        graph of its row count, one row per token (``InputBuilder.verify_batch``): no eager
        attention between piecewise segments. None where no graph holds it."""
        if not self._graphs_serve(states) or self.graphs is None:
            return None
        vb = self.inputs.verify_batch(out, states, starts)
        if vb is None or self.graphs.bucket(len(vb[0])) is None:
            return None
        ids, pos, rows_states, drafts = vb
        logits, greedy, drawn = self._decode_step(ids, pos, [], [], rows_states, before_sample is None)
        if before_sample is not None:
            before_sample()
        mask = _verify_mask(out.grammar_bitmask, drafts)
        handle = self._sample(logits, rows_states, pos + 1, greedy, mask, drawn)
        handle.drafts = drafts
        self.num_graph_verify_steps += 1
        return handle

    def collect(self, h: StepHandle) -> tuple[list[int], list[Logprobs | None] | None]:
        """Wait for a launched step; its sampled ids (and logprobs) as Python lists. Each
        request's host-side tokens grow by what it sampled."""
        sampled, logprobs = self.sampling.collect(h)
        if h.pooled:
            h.pooled = to_host(h.pooled)
        if h.drafts is not None:
            kept = self._accept(h, sampled, logprobs)
            if self.draft is not None and h.num_tokens is not None:
                firsts = np.cumsum([0] + [len(d) + 1 for d in h.drafts[:-1]])
                ids = [h.states[a].req_id for a in firsts]
                self.draft.accepted(dict(zip(ids, h.num_tokens, strict=True)))
            return kept
        for st, tok in zip(h.states, sampled, strict=True):
            st.token_ids.append(tok)
        return sampled, logprobs

    @staticmethod
    def _accept(
        h: StepHandle, sampled: list[int], logprobs: list[Logprobs | None] | None
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """A verify step's rows to each request's kept tokens, flat (``h.num_tokens`` each)."""
        assert h.drafts is not None
        kept: list[int] = []
        kept_lps: list[Logprobs | None] = []
        h.num_tokens = []
        a = 0
        counts = h.counts.tolist() if h.counts is not None else None
        for r, d in enumerate(h.drafts):
            if counts is None:
                toks = accept_point_mass(sampled[a : a + len(d) + 1], d)
            else:  # a draft model's verify step drew them already
                toks = sampled[a : a + counts[r]]
            h.states[a].token_ids.extend(toks)
            kept += toks
            if logprobs is not None:
                kept_lps += logprobs[a : a + len(toks)]
            h.num_tokens.append(len(toks))
            a += len(d) + 1
        return kept, kept_lps if logprobs is not None else None

    def _decode_step(
        self,
        ids: np.ndarray,
        pos: np.ndarray,
        dst: list[int],
        src: list[int],
        states: list[ReqState],
        may_draw: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Logits of a pure-decode batch, their ids when a CUDA graph computed them (the argmax,
        or every row's draw), and whether the graph drew every row's token. ``may_draw``: no
        grammar bitmask will apply to these logits, so the graph may sample them."""
        bs, n = self.block_size, len(ids)
        table = self.inputs.table(states, int(pos.max()) // bs + 1)
        slots = table.numpy()[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        lora_rows = self.lora is not None and any(s.lora_slot for s in states)
        g = self.lora_graphs if lora_rows else self.graphs
        if self.use_cuda_graphs and g is not None and (bucket := g.bucket(n)):
            if self.lora is not None:
                # the graphs hold no eager grouping (an emulated replay re-runs the forward)
                self.lora.groups = []
            if lora_rows:  # each row's adapter, padded rows the base model's (slot 0)
                assert self.lora is not None
                slots_host = np.zeros(bucket, dtype=np.int32)
                slots_host[:n] = [s.lora_slot for s in states]
                self._staging.put("lora", slots_host, torch.int32, out=self.lora.slots[:bucket])
            params = self._graph_params(states, pos + 1) if may_draw else None
            if g.patch_in_graph and (
                self._prev_sampled is not self._graph_ids or self._graph_owner is not g
            ):
                b = g.stage(ids, pos, slots, table, params=params)  # patch rows all off ...
                self._patch(g.tokens[0], dst, src)  # ... the tokens came from elsewhere
            else:  # patch rows copied with the rest
                b = g.stage(ids, pos, slots, table, dst, src, params=params)
                if dst and not g.patch_in_graph:
                    self._fill_sampled(g.tokens[0], g.patch[:, : len(dst)])
            self._staging.fence()
            logits, self._graph_ids = g.replay(b, n)
            self._graph_owner = g  # its ``sampled`` holds them (the in-graph patch reads it)
            return logits, self._graph_ids, params is not None
        seq_lens = pos + 1
        st, dev = self._staging, self.device
        meta = AttentionMetadata.build(
            query_start_loc=self._arange[: n + 1],
            seq_lens=st.put("seq_lens", seq_lens, torch.int32),
            block_tables=table.to(dev, non_blocking=True),
            slot_mapping=st.put("slots", slots, torch.int64),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=seq_lens.tolist(),
        )
        ids_dev = st.put("ids", ids, torch.int64)
        self._patch(ids_dev, dst, src)
        pos_dev = st.put("pos", pos, torch.int64)
        st.fence()
        if self.lora is not None:
            self.lora.set_rows(np.array([s.lora_slot for s in states]))
        hidden = self.model(ids_dev, pos_dev, self.kv_caches, meta)
        return self.model.compute_logits(hidden), None, False

    def _graphs_serve(self, states: list[ReqState]) -> bool:
        """Whether the base model's graphs (decode, piecewise prefill) may run this step: they
        hold no LoRA path, so a step with adapter rows runs eagerly, or, when it decodes only,
        through ``lora_graphs``."""
        return self.use_cuda_graphs and (self.lora is None or not any(s.lora_slot for s in states))

    def _graph_params(self, states: list[ReqState], positions: np.ndarray) -> np.ndarray | None:
        """The decode graph's sampling rows for ``states`` when it can draw every row itself:
        its graphs sample, the sort-free sampler is on, and every row is plain greedy or
        within that sampler's reach (some not greedy). None: the argmax alone, then the step's
        sampler."""
        kc, g = self.kernel_config, self.graphs
        if g is None or not (g.sample_in_graph and kc.sample_in_graph and kc.fused_sampler):
            return None
        greedy = True  # one pass over the batch: every row greedy, or one out of reach
        for st in states:
            if st.edits is not None:  # the graph's sampler edits no logits
                return None
            if not st.plain_greedy:
                if not st.fused_sample:
                    return None
                greedy = False
        if greedy:
            return None
        return fused_params([st.params for st in states], [st.index for st in states], positions)

    def _general_step(
        self,
        out: SchedulerOutput,
        states: list[ReqState],
        starts: list[int],
        guesses: DraftGuesses | None = None,
    ) -> tuple[torch.Tensor | None, list[int], np.ndarray, list[list[int]] | None, list | None]:
        """Prefill chunks and mixed batches; returns logits of the rows to sample, those rows,
        their sampled tokens' positions, in a verify step each row's guesses, and the prompt
        logprobs of requests that ask for them (``worker/prompt_logprobs.py``). Eager, or
        through the piecewise graphs of the token bucket that holds the step."""
        gb = self.inputs.general_batch(out, states, starts, self._prev_rows, self.block_size)
        total, qsl, rows = gb.total, gb.qsl, gb.rows
        pw = self.piecewise if self._graphs_serve(states) else None
        bucket = pw.bucket(total) if pw is not None else None
        static: tuple[torch.Tensor | None, ...] = (None, None, None)
        if bucket is not None:  # staged straight into the graphs' static inputs
            assert pw is not None
            gb.pad(bucket)
            static = pw.inputs(bucket)
        st, dev = self._staging, self.device
        meta = AttentionMetadata.build(
            query_start_loc=st.put("qsl", qsl, torch.int32),
            seq_lens=st.put("seq_lens", gb.seq_lens, torch.int32),
            block_tables=gb.table.to(dev, non_blocking=True),
            slot_mapping=st.put("slots", gb.slots, torch.int64, out=static[2]),
            max_query_len=int(gb.counts.max()),
            max_seq_len=int(gb.seq_lens.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=gb.seq_lens.tolist(),
        )
        ids_dev = st.put("ids", gb.ids, torch.int64, out=static[0])
        self._patch(ids_dev, gb.dst, gb.src)
        if guesses is not None:  # the draft's guesses, drawn on the device
            spec_rows = [i for i, s in enumerate(states) if out.scheduled_spec_decode_tokens.get(s.req_id)]
            guesses.fill(ids_dev, qsl, spec_rows)
        pos_dev = st.put("pos", gb.positions, torch.int64, out=static[1])
        last_rows = qsl[1:][rows] - 1
        spec = out.scheduled_spec_decode_tokens
        drafts = [spec.get(states[i].req_id, []) for i in rows] if spec else None
        if drafts is not None:  # verify rows: logits at the last token and at each guess
            last_rows = _verify_rows(last_rows, drafts)
        last = st.put("last", last_rows, torch.int64) if rows else None
        st.fence()
        if bucket is not None:
            assert pw is not None
            # each layer's own attention: its scale, sliding window and soft-cap
            kv, layers = self.kv_caches, pw.model.layers
            attend = lambda i, q, k, v: layers[i].self_attn.backend.attend(q, k, v, kv[i], meta)  # noqa: E731
            if self.lora is not None:  # base rows only (``_graphs_serve``), no eager grouping
                self.lora.groups = []
            hidden = pw.run(bucket, attend)
        else:
            if self.lora is not None:
                self.lora.set_rows(np.repeat([s.lora_slot for s in states], gb.counts))
            hidden = self.model(ids_dev, pos_dev, self.kv_caches, meta)
        prompt_lps = None
        if any(st.params.prompt_logprobs is not None for st in states):
            prompt_lps = chunk_prompt_logprobs(
                self.model.compute_logits, hidden, qsl, states, starts
            )
        if self.pooler is not None:
            self._pooled = self.pooler.step(hidden, qsl, states, starts)
            head = getattr(self.model, "score", None)  # a classifier's labels
            if head is not None and self._pooled:
                vecs = torch.stack([v for _, v in self._pooled]).to(self.dtype)
                logits = head(vecs).float()
                self._pooled = [(rid, logits[i]) for i, (rid, _) in enumerate(self._pooled)]
        ends = gb.seq_lens[rows]
        if last is None:
            return None, rows, ends, drafts, prompt_lps
        return self.model.compute_logits(hidden[last]), rows, ends, drafts, prompt_lps

    # -- sampling -----------------------------------------------------------------------------

    def _sample(
        self,
        logits: torch.Tensor | None,
        states: list[ReqState],
        positions: np.ndarray,
        greedy: torch.Tensor | None = None,
        bitmask: np.ndarray | None = None,
        graph_sampled: bool = False,
    ) -> StepHandle:
        """Sample on the device and start copying the result to the host; the sampled ids stay
        on the device for the next step's inputs. ``positions``: each row's sampled token's;
        ``greedy``: a decode graph's ids (with ``graph_sampled``, its draws of every row);
        ``bitmask``: the grammar's allowed tokens per row (structured output)."""
        self._prev_rows = {st.req_id: i for i, st in enumerate(states)}
        handle, self._prev_sampled = self.sampling.sample(
            logits, states, positions, greedy, bitmask, graph_sampled
        )
        return handle


def _verify_mask(mask: np.ndarray | None, drafts: list[list[int]]) -> np.ndarray | None:
    """The grammar bitmask of a verify step's rows. A request with a grammar is never
    speculated (its mask covers one position), so each verify row of another request repeats
    that request's all-allowed mask row."""
    if mask is None:
        return None
    return np.repeat(mask, [len(d) + 1 for d in drafts], axis=0)


def _verify_rows(last: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """Each request's ``last`` index widened to its ``len(drafts) + 1`` verify rows::

        last 9, 2 guesses -> 7, 8, 9
    """
    return np.concatenate(
        [np.arange(e - len(d), e + 1, dtype=np.int64) for e, d in zip(last, drafts, strict=True)]
    )
