"""CUDA graphs for prefill and mixed steps, captured piecewise around attention.

Run eagerly, a step launches every op of every layer from Python, and for a short prompt the
host takes longer to launch them than the GPU takes to run them (on an H200, hundreds of µs of
host time per layer). Attention cannot join a graph here: its launches depend on the step's
requests (the prefill kernel's work list, the decode rows). Everything else in a layer -- norms,
the four GEMMs, rotary, SiLU -- depends on the token count only. So each token bucket ``T`` gets
``L + 1`` graphs, the model's segments between attention calls (``LlamaModel.segment``; each
but the last ends by writing its layer's K/V into the cache, which also depends on the token
count only), and a step of ``n <= T`` tokens replays them with each layer's attention run
eagerly in between::

    stage ids, positions, KV slots (padded to T)
    replay segment 0 ─► q of layer 0, its K/V written ─► attention (eager, this step's requests)
    replay segment 1 (o_proj + MLP of layer 0; norm, qkv, rotary, KV write of layer 1) ─► ...
    replay segment L ─► hidden states [T, hidden]      (logits of the sampled rows: eager)

    rows  0 .. n-1: the step's tokens | n .. T-1: padding, id 0, position 0, KV slot -1 (not
          written). Attention leaves padding rows as they were and every op in a segment works
          row by row, so padding never reaches a real row.

Graphs share one memory pool and are captured largest bucket first; a segment's outputs are held
only while the next segment is captured (they are its inputs), then kept as weak views
(``weak_views``): a replay's outputs are read before the next segment's replay writes over them,
so the pool stays the size of one bucket's two neighbouring segments, not of every layer's
outputs in every bucket. The attention rows go through one static buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fulcrum.worker.cuda_graph import EmulatedGraph, weak_views

# attend(layer, q, k, v) -> attention rows [T, heads, head_dim] for this step's requests
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 8, 16, ..., 256 (doubling), then every 256, up to ``max_tokens``."""
    sizes = [8, 16, 32, 64, 128, 256, *range(512, max_tokens + 1, 256)]
    out = [s for s in sizes if s <= max_tokens]
    if not out or out[-1] != max_tokens:
        out.append(max_tokens)
    return out


class PiecewiseGraphs:
    """Static token inputs plus one list of segment graphs per token bucket."""

    def __init__(
        self,
        model: torch.nn.Module,  # a LlamaModel: ``segment`` and ``layers``
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        emulate: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_layers = len(model.layers)
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.emulate = emulate or device.type != "cuda"
        t = self.max_tokens
        self.ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(t, num_heads, head_dim, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph | EmulatedGraph]] = {}
        self.outputs: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        self.pool = None
        self.capture_time = 0.0
        self.num_replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest captured token count that holds ``n`` tokens (None: too many)."""
        if n > self.max_tokens or not self.graphs:
            return None
        return next(s for s in self.sizes if s >= n)

    def _segment(self, t: int, i: int, prev: tuple[torch.Tensor, ...] | None):
        # Views are taken inside each call: the torch rotary path memoises cos/sin by the
        # positions tensor's identity, and the static buffer's content changes between steps.
        model = self.model
        residual = prev[3] if prev is not None else None
        if i == self.num_layers:
            return lambda: (
                model.segment(
                    i, self.positions[:t], self.slots[:t], o=self.attn_out[:t], residual=residual
                ),
            )

        def run() -> tuple[torch.Tensor, ...]:
            pos, slots, kv = self.positions[:t], self.slots[:t], self.kv_caches[i]
            if i == 0:
                return model.segment(0, pos, slots, kv, input_ids=self.ids[:t])
            return model.segment(i, pos, slots, kv, o=self.attn_out[:t], residual=residual)

        return run

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        for t in reversed(self.sizes):
            graphs, outs, prev = [], [], None
            for i in range(self.num_layers + 1):
                fn = self._segment(t, i, prev)
                if self.emulate:
                    g = EmulatedGraph(fn)
                    out = g.output
                else:
                    fn()  # warm-up: Triton variants compile outside capture
                    torch.cuda.synchronize()
                    if self.pool is None:
                        self.pool = torch.cuda.graph_pool_handle()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        out = fn()
                graphs.append(g)
                outs.append(out if self.emulate else weak_views(out))
                prev = out  # held through the next segment's capture, which reads it
            self.graphs[t], self.outputs[t] = graphs, outs
            prev = out = None  # the bucket's last outputs: free for the next bucket's capture
        if not self.emulate:
            torch.cuda.synchronize()
        self.capture_time = time.perf_counter() - t0
        return self.capture_time

    def inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static (ids, positions, KV slots) of bucket ``t``, for the caller to fill."""
        return self.ids[:t], self.positions[:t], self.slots[:t]

    def run(self, t: int, attend: Attend) -> torch.Tensor:
        """One step on bucket ``t`` over its filled ``inputs``; ``attend`` must not write K/V
        (the segments did). Returns the hidden states ``[t, hidden]`` (pool memory, valid until
        the next replay)."""
        graphs, outs = self.graphs[t], self.outputs[t]
        for i in range(self.num_layers):
            graphs[i].replay()
            q, k, v, _ = outs[i]
            self.attn_out[:t].copy_(attend(i, q, k, v))
        graphs[-1].replay()
        self.num_replays += 1
        return outs[-1][0]
