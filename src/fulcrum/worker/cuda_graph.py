"""CUDA graphs for pure-decode steps.

One graph per batch-size bucket, replayed on padded batches.

A decode step of ``n`` requests runs the graph of the smallest bucket ``b >= n``. Every graph
reads the same static device buffers (sliced to ``b`` rows) and writes its logits into memory of
one shared pool::

    host (pinned, numpy views)                 device (static, read by every graph)
    ┌ tokens [3, B_max] int64 ┐                 tokens[0] input ids | [1] positions | [2] slots
    │ patch  [2, B_max] int64 │ ── one copy ──► patch: rows of tokens[0] to fill from the
    │ params [B_max, 6] int32 │                        previous step's sampled ids (on device)
    └ seq_lens [B_max] int32  ┘                 params: each row's sampling (sample_in_graph)
                                                seq_lens
                                                sampled [B_max]: every graph's sampled ids
    table [n, width] int32 ── a copy when it ─► block_tables[:n, :width]   (rest: stale, unread)
    (the runner's staging)    changed (a new block)
                                                query_start_loc = 0, 1, ..., B_max  (constant)

    rows:  0 .. n-1 real requests | n .. b-1 padding: id 0, position 0, slot -1 (KV not
           written), seq_len 0 (the decode kernel reads no KV and writes zeros)

The patch is the graph's first kernel (``graph_patch``): rows ``patch[0, i] >= 0`` take
``sampled[patch[1, i]]``, the ids the previous replay wrote; the rest are off (-1). When the
previous step's tokens came from elsewhere (the sampler, an eager step), the runner fills them
before the replay and stages every row off.

The graph's last kernels write ``sampled``: the argmax of every row, then, with
``sample_in_graph``, the sort-free sampler (``kernels/sample.py``) over the rows whose staged
``params`` have a temperature (``pack_params``' layout; zero rows: greedy, left as the argmax
wrote them). A sampled decode step then launches nothing between two replays, and its ids
patch the next step's inputs from inside the next graph, as greedy ids do.

Graphs are captured largest first so the smaller ones reuse the pool's memory (a graph keeps
only weak views of its outputs, ``weak_views``), after one eager
step at the largest bucket (it grows the decode kernel's split-KV scratch once, outside any
graph). Triton's variants are compiled before the loop, by compile-ahead's dry run
(``capture_warmup``). Both switches are the engine's ``KernelConfig`` fields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from fulcrum.attention.backend import AttentionMetadata
from fulcrum.config import KernelConfig
from fulcrum.worker.host_staging import pinned
from fulcrum.worker.precompile import compile_ahead

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512

# forward(input_ids, positions, meta, out=None) -> (logits [num_tokens, vocab], greedy ids
# [num_tokens], written into ``out`` when given)
DecodeForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def weak_views(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Views of a captured graph's outputs that do not keep their pool memory allocated.

    A replay's outputs are read before the next replay of any graph of the pool, so the later
    captures may reuse that memory. Held for real, every bucket's outputs would stay: the decode
    graphs' logits alone come to (sum of the buckets) x vocab x 2 bytes, 2.7 GB at 512 rows and
    a 128k vocabulary, and each piecewise bucket would keep every layer's q/k/v and residual.
    None of it would be in the KV profile, which runs before capture.
    """
    return tuple(_weak_view(t) for t in tensors)


def _weak_view(t: torch.Tensor) -> torch.Tensor:
    s = t.untyped_storage()
    # the same construction torch's own CUDA-graph trees use for pool-owned outputs
    weak = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(weak, t.storage_offset(), t.shape, t.stride())


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, ..., 256, 272, ..., 512, up to ``max_num_seqs`` (capped)."""
    cap = max(1, min(max_num_seqs, MAX_CAPTURE_SIZE))
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    out = [s for s in sizes if s <= cap]
    if out[-1] != cap:
        out.append(cap)
    return out


class _CompileCounter:
    """Counts the Triton kernel variants compiled (in-process cache misses) inside ``with``."""

    def __enter__(self) -> _CompileCounter:
        self.n, self.reprs = 0, []
        try:
            from triton import knobs
        except ImportError:
            self._knobs = None
            return self
        self._knobs, self._prev = knobs.runtime, knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.n += 1
            self.reprs.append(str(kwargs.get("repr", "?")))
            return self._prev(*args, **kwargs) if self._prev else False

        self._knobs.jit_cache_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._prev


class EmulatedGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` off CUDA: replay re-runs the captured function on
    the same static buffers, so the padding and buffer logic can be checked on the CPU."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        for out, new in zip(self.output, self.fn(), strict=True):
            out.copy_(new)


class DecodeGraphs:
    """Static decode inputs plus one captured graph per bucket; ``stage`` then ``replay`` run one step."""

    def __init__(
        self,
        forward: DecodeForward,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        max_seq_len: int,
        device: torch.device,
        emulate: bool = False,
        kernel_config: KernelConfig | None = None,
        sample_in_graph: bool = False,
    ) -> None:
        self.forward = forward
        self.sample_in_graph = sample_in_graph
        self.kernel_config = kernel_config if kernel_config is not None else KernelConfig()
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.device = device
        self.emulate = emulate or device.type != "cuda"
        b, dev = self.max_batch, device
        # Device side: what every graph reads. Tokens, patch rows, sampling params and seq_lens
        # share one buffer (int64 words: tokens [0, 3b), patch [3b, 5b), params [5b, 8b) as
        # int32 [b, 6], seq_lens as int32 after), one copy.
        words = 8 * b + (b + 1) // 2
        self._dev = torch.zeros(words, dtype=torch.int64, device=dev)
        self.tokens = self._dev[: 3 * b].view(3, b)
        self.patch = self._dev[3 * b : 5 * b].view(2, b)
        self.params = self._dev[5 * b : 8 * b].view(torch.int32).view(b, 6)
        self.seq_lens = self._dev[8 * b :].view(torch.int32)[:b]
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        # The sampled-id patch inside each graph rather than a launch between replays: measured
        # faster on an H200, where a kernel launched between two replays slows the next replay
        # (an H2D copy there does not).
        self.patch_in_graph = self.kernel_config.graph_patch
        self.sampled = torch.zeros(b, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # Host side: pinned staging of the same layout, filled through numpy views.
        self._host = pinned((words,), torch.int64, dev)
        h = self._host.numpy()
        self.h_tokens = h[: 3 * b].reshape(3, b)
        self.h_patch = h[3 * b : 5 * b].reshape(2, b)
        self.h_params = h[5 * b : 8 * b].view(np.int32).reshape(b, 6)
        self.h_seq_lens = h[8 * b :].view(np.int32)[:b]
        self._table: np.ndarray | None = None  # the block table rows on the device now
        self.graphs: dict[int, torch.cuda.CUDAGraph | EmulatedGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.capture_time = 0.0
        self.warmup_time = 0.0  # seconds of eager warm-ups in the capture loop
        self.compiled_in_loop = 0  # Triton variants compiled in the capture loop
        self.num_replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` requests (None: too many)."""
        if n > self.max_batch or not self.graphs:
            return None
        for s in self.sizes:
            if s >= n:
                return s
        return None

    # -- capture ------------------------------------------------------------------------------

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.tokens[2, :b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[0] * b,
        )

    def _run_static(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos = self.tokens[0, :b], self.tokens[1, :b]
        if not self.patch_in_graph:
            return self._sample(*self.forward(ids, pos, self._meta(b)), b)
        rows = self.patch[:, :b]
        if self.device.type == "cuda":
            from fulcrum.kernels.scatter import gather_scatter

            gather_scatter(self.tokens[0], rows, self.sampled)
        else:  # emulated replays: a boolean mask is fine off CUDA
            on = rows[0] >= 0
            ids.index_copy_(0, rows[0][on], self.sampled.index_select(0, rows[1][on]))
        return self._sample(*self.forward(ids, pos, self._meta(b), out=self.sampled[:b]), b)

    def _sample(
        self, logits: torch.Tensor, ids: torch.Tensor, b: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``sample_in_graph``, the rows staged with a temperature drawn over the argmax."""
        if self.sample_in_graph:
            from fulcrum.kernels.sample import sample_rows

            sample_rows(logits, self.params[:b], out=ids, skip_greedy=True)
        return logits, ids

    def _fill_padding(self) -> None:
        """Every row a padding row: writes no KV, reads no KV; every patch row off."""
        self.h_tokens[0] = 0
        self.h_tokens[1] = 0
        self.h_tokens[2] = -1
        self.h_seq_lens[:] = 0
        self.h_params[:] = 0
        self.h_patch[0] = -1
        self.h_patch[1] = 0
        self._dev.copy_(self._host)
        self.block_tables.zero_()
        self._table = None

    def _no_op_patch(self) -> None:
        """The sampled-id patch before each replay (``kernels/scatter.py``), ids[0] = ids[0]:
        it compiles at start-up, not at the first request."""
        from fulcrum.kernels.scatter import gather_scatter

        self.patch[:, :1].zero_()
        gather_scatter(self.tokens[0], self.patch[:, :1], self.tokens[0])
        self.patch[0, :1] = -1  # off again, for any eager step before the first staging

    def _warm_up(self) -> None:
        """The steps of the buckets up to 8, of each power of two and of the bucket below it
        (the batch sizes where a kernel's variant can change: its grid against the SM count,
        split or not, sorted by context from 64 requests up), the largest, and the patch. A
        variant this misses compiles inside the capture loop (the log counts them)."""
        sizes = self.sizes
        for i in reversed(range(len(sizes))):
            b, nxt = sizes[i], sizes[i + 1] if i + 1 < len(sizes) else 1
            if b <= 8 or b & (b - 1) == 0 or nxt & (nxt - 1) == 0 or b == self.max_batch:
                self._run_static(b)
        self._no_op_patch()

    def dry_run(self) -> None:
        """The warm-up steps on padding rows, without capturing: for ``compile_ahead`` to
        compile their variants (start-up's profiling pass, before the KV pool exists)."""
        self._fill_padding()
        self._warm_up()

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        self._fill_padding()
        kc = self.kernel_config
        ahead = None
        if not self.emulate:
            ahead = compile_ahead(self._warm_up, "decode-graph capture", kc.compile_ahead)
        self._run_static(self.max_batch)  # eager step at the largest batch: scratch grows now
        if self.emulate:
            for b in reversed(self.sizes):
                g = EmulatedGraph(lambda b=b: self._run_static(b))
                self.graphs[b], self.outputs[b] = g, g.output
        else:
            torch.cuda.synchronize(self.device)
            self.pool = torch.cuda.graph_pool_handle()
            # The eager warm-up step before each bucket's capture keeps Triton compiles out of the
            # capture. Where compile-ahead's dry run ran it is skipped unless capture_warmup: a
            # variant the dry run missed compiles in the capture itself, and the start-up log
            # counts those (none on the H200 at Llama-8B shapes).
            warm = kc.capture_warmup or ahead is None
            with _CompileCounter() as compiled:
                for b in reversed(self.sizes):
                    if warm:
                        tw = time.perf_counter()
                        self._run_static(b)  # Triton variants compile outside capture
                        torch.cuda.synchronize(self.device)
                        self.warmup_time += time.perf_counter() - tw
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        out = self._run_static(b)
                    self.graphs[b], self.outputs[b] = g, weak_views(out)
                    del out
            self.compiled_in_loop = compiled.n
            for r in compiled.reprs:
                logger.info("Compiled in the decode-graph capture loop: %s", r)
            self._no_op_patch()
            torch.cuda.synchronize(self.device)
        self.capture_time = time.perf_counter() - t0
        return self.capture_time

    # -- replay -------------------------------------------------------------------------------

    def stage(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,  # [n] int64
        slots: np.ndarray,  # [n] int64
        table: torch.Tensor,  # [n, width] int32, contiguous host tensor (pinned on CUDA)
        dst: list[int] | None = None,  # rows of input_ids that the previous step sampled ...
        src: list[int] | None = None,  # ... and their rows in its sampled ids
        params: np.ndarray | None = None,  # [n, 6] int32 (pack_params): sample in the graph
    ) -> int:
        """Copy one decode step of ``n`` requests into the static inputs; returns its bucket.
        ``patch[:, :len(dst)]`` then holds ``dst``/``src`` on the device (with
        ``patch_in_graph``, the graph fills those rows from ``sampled``: pass them only when
        the previous step's tokens are the last replay's ids). ``params`` (with
        ``sample_in_graph``): each row's sampling, drawn by the graph's sampler; None: every row
        keeps the argmax. The host buffers must not change until the copies are done (the
        runner's staging fence, recorded after this call, guards them)."""
        n, width = table.shape
        b = self.bucket(n)
        assert b is not None and width <= self.max_blocks
        ht = self.h_tokens
        ht[0, :n] = input_ids
        ht[1, :n] = positions
        ht[2, :n] = slots
        ht[0, n:b] = 0
        ht[1, n:b] = 0
        ht[2, n:b] = -1
        hs = self.h_seq_lens
        np.add(positions, 1, out=hs[:n], casting="unsafe")
        hs[n:b] = 0
        k = len(dst) if dst else 0
        if k:
            self.h_patch[0, :k] = dst
            self.h_patch[1, :k] = src
        if self.patch_in_graph:
            self.h_patch[0, k:b] = -1
        if self.sample_in_graph:
            hp = self.h_params
            if params is None:
                hp[:b] = 0
            else:
                hp[:n] = params
                hp[n:b] = 0
        else:
            assert params is None, "stage: params for graphs that do not sample"
        self._dev.copy_(self._host, non_blocking=True)
        rows = table.numpy()
        last = self._table
        if last is None or last.shape != rows.shape or not np.array_equal(last, rows):
            self.block_tables[:n, :width].copy_(table, non_blocking=True)
            self._table = rows.copy()
        return b

    def replay(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run bucket ``b`` on the staged inputs; returns logits ``[n, vocab]`` and their sampled
        ids ``[n]`` (the argmax, or the staged params' draws; graph-owned memory, valid until
        the next replay)."""
        self.graphs[b].replay()
        self.num_replays += 1
        logits, ids = self.outputs[b]
        return logits[:n], ids[:n]
