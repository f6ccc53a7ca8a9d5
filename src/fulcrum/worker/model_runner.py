"""ModelRunner: owns the model and the KV pool; turns a SchedulerOutput into sampled tokens.

Per step it builds the flattened batch (token ids, positions, slot mapping, block tables) with
numpy, runs the model, gathers the hidden state of each request whose last known token was
computed, and samples those rows.
"""

from __future__ import annotations

import logging
import numpy as np
import torch

from fulcrum.attention.backend import AttentionMetadata, get_backend_cls
from fulcrum.config import EngineConfig
from fulcrum.engine.protocol import Logprobs
from fulcrum.engine.request import Request
from fulcrum.model.loader.weights import load_model
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.worker.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_GIB = 2.0


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = config.device
        self.dtype = mc.dtype
        self.block_size = config.cache_config.block_size
        num_heads = mc.hf_config.num_attention_heads
        backend_cls = get_backend_cls(config.attention_backend, self.device)
        self.attn_backend = backend_cls(num_heads, mc.num_kv_heads, mc.head_dim, mc.head_dim**-0.5)
        torch.manual_seed(mc.seed)
        self.model, self.load_time = load_model(mc, self.attn_backend, self.device)
        self.sampler = Sampler()
        self.vocab_size = mc.vocab_size
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    # -- KV cache -----------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        mc = self.config.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        if self.device.type == "cuda" and cc.kv_cache_memory is None:
            return self._profile_cuda_blocks()
        gib = cc.kv_cache_memory if cc.kv_cache_memory is not None else _DEFAULT_CPU_KV_GIB
        return max(2, int(gib * (1 << 30)) // self.bytes_per_block)

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Run a maximal batch without a KV pool, then give the pool what utilisation allows."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler_config.max_num_batched_tokens
        self._dummy_forward(n)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.cache_config.gpu_memory_utilization - peak - used_by_others
        blocks = int(budget // self.bytes_per_block)
        if blocks < 2:
            raise ValueError(
                f"gpu_memory_utilization: no room for the KV cache (peak {peak / 2**30:.1f} GiB "
                f"of {total / 2**30:.1f} GiB); raise it or lower max_num_batched_tokens."
            )
        return blocks

    def _dummy_forward(self, num_tokens: int) -> None:
        mc = self.config.model_config
        shape = (2, 1, self.block_size, mc.num_kv_heads, mc.head_dim)
        scratch = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device) % max(1, self.block_size)
        meta = AttentionMetadata(
            num_tokens=num_tokens, num_reqs=num_tokens,
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=self.device),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            max_query_len=1, max_seq_len=1,
            query_start_loc_cpu=list(range(num_tokens + 1)), seq_lens_cpu=[1] * num_tokens,
        )
        hidden = self.model(ids, pos * 0, scratch, meta)
        self.model.compute_logits(hidden[: self.config.scheduler_config.max_num_seqs]).float()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model_config
        shape = (2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)
        ]
        self.num_blocks = num_blocks

    # -- one step -----------------------------------------------------------------------------

    def _prepare(self, out: SchedulerOutput, block_tables: list[list[int]]):
        bs = self.block_size
        starts = np.array([r.num_computed_tokens for r, _ in out.scheduled], dtype=np.int64)
        counts = np.array([n for _, n in out.scheduled], dtype=np.int64)
        qsl = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])
        req_of_tok = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(total, dtype=np.int64) - qsl[req_of_tok] + starts[req_of_tok]
        ids = np.empty(total, dtype=np.int64)
        for i, (r, n) in enumerate(out.scheduled):
            ids[qsl[i] : qsl[i + 1]] = r.all_token_ids[starts[i] : starts[i] + n]
        width = max(len(b) for b in block_tables)
        table = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, b in enumerate(block_tables):
            table[i, : len(b)] = b
        slots = table[req_of_tok, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts + counts
        return ids, positions, slots, qsl, seq_lens, table

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: list[list[int]]
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        dev = self.device
        ids, positions, slots, qsl, seq_lens, table = self._prepare(out, block_tables)
        sample_rows = [
            i for i, (r, n) in enumerate(out.scheduled) if r.num_computed_tokens + n == r.num_tokens
        ]
        meta = AttentionMetadata(
            num_tokens=len(ids),
            num_reqs=len(out.scheduled),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        hidden = self.model(
            torch.from_numpy(ids).to(dev, non_blocking=True),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            self.kv_caches,
            meta,
        )
        if not sample_rows:
            return [], None
        last = torch.tensor([qsl[i + 1] - 1 for i in sample_rows], device=dev)
        logits = self.model.compute_logits(hidden[last]).float()
        reqs = [out.scheduled[i][0] for i in sample_rows]
        smeta = self._sampling_metadata(reqs)
        result = self.sampler(logits, smeta)
        tokens = result.sampled_token_ids.tolist()
        return tokens, self._logprobs(reqs, result)

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        for r in reqs:
            if r.params.seed is not None and r.generator is None:
                r.generator = torch.Generator(device=self.device).manual_seed(r.params.seed + r.index)
        return SamplingMetadata.build(
            [r.params for r in reqs],
            [r.generator for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs],
            self.vocab_size,
            self.device,
        )

    @staticmethod
    def _logprobs(reqs: list[Request], result) -> list[Logprobs] | None:
        if result.logprobs is None:
            return None
        lps = result.logprobs.tolist()
        ids = result.logprob_token_ids.tolist()
        ranks = result.sampled_ranks.tolist()
        out: list[Logprobs | None] = []
        for i, r in enumerate(reqs):
            if r.params.logprobs is None:
                out.append(None)
                continue
            k = r.params.logprobs
            out.append(Logprobs(lps[i][0], ranks[i], ids[i][1 : k + 1], lps[i][1 : k + 1]))
        return out
