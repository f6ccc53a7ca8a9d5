"""A ModelRunner's start-up: KV profiling, the KV pool, then CUDA-graph capture.

Runs once, before the first step, and does no per-step work::

    prepare_runner(runner)
      ├─ determine_num_blocks   the configured size, or (CUDA) profile a maximal step without a
      │    KV pool: compile-ahead's dry pass first (``compile_pass``: that step plus the decode
      │    graphs' warm-up steps over a one-block scratch cache, their Triton variants compiled
      │    in one parallel batch), then the real step, whose peak memory sizes the pool; with
      │    a configured size on CUDA, the same two passes (the prefill kernels compile there)
      ├─ runner.allocate_kv_cache(num_blocks)
      └─ (CUDA, not enforce_eager) capture_graphs: one decode graph per batch bucket (and
           the draft model's, ``draft_graphs.py``);
           capture_piecewise: prefill/mixed steps as segment graphs per token bucket

A failed capture is an optimisation lost: a warning, and those steps stay eager.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from fulcrum.attention.backend import AttentionMetadata
from fulcrum.config import EngineConfig
from fulcrum.kernels.dispatch import use_triton
from fulcrum.worker.cuda_graph import DecodeGraphs, capture_sizes
from fulcrum.worker.draft_graphs import capture_draft_graphs, new_decode_graphs
from fulcrum.worker.model_runner import ModelRunner
from fulcrum.worker.piecewise_graph import PiecewiseGraphs, token_buckets
from fulcrum.worker.precompile import compile_ahead
from fulcrum.worker.sampler import greedy_argmax

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_GIB = 2.0


def prepare_runner(runner: ModelRunner, agree: Callable[[int], int] | None = None) -> int:
    """Size and allocate the KV pool, then capture the graphs; returns the pool's block count.
    ``agree``: the count every tensor-parallel rank can hold, from each rank's own."""
    num_blocks = determine_num_blocks(runner)
    if agree is not None:
        num_blocks = agree(num_blocks)
    runner.allocate_kv_cache(num_blocks)
    if runner.device.type == "cuda" and not runner.config.enforce_eager:
        if runner.pooler is None:  # an embedding model's prompts never decode
            capture_graphs(runner)
            capture_draft_graphs(runner)
        pooler = runner.config.model_config.pooler_config
        encoder = pooler is not None and pooler.bidirectional  # no layer halves to capture
        if runner.config.piecewise_graph_max_tokens > 0 and not encoder:
            capture_piecewise(runner)
    return num_blocks


# -- KV profiling -----------------------------------------------------------------------------


def determine_num_blocks(runner: ModelRunner) -> int:
    cc = runner.config.cache_config
    cuda = runner.device.type == "cuda"
    pooler = runner.config.model_config.pooler_config
    if pooler is not None and pooler.bidirectional and cc.num_blocks is None:
        # An encoder reads no KV: its blocks only count each step's prompts in and out. Two
        # steps' worth (asynchronous scheduling holds one while the next is scheduled).
        sc = runner.config.scheduler_config
        if cuda:
            _compile_pass_without_profiling(runner)
        return 2 * (-(-sc.max_num_batched_tokens // runner.block_size) + sc.max_num_seqs)
    if cc.num_blocks is None and cuda and cc.kv_cache_memory is None:
        t0 = time.perf_counter()
        blocks = _profile_cuda_blocks(runner)
        runner.timings["kv_profile_s"] = time.perf_counter() - t0
        logger.info("KV profiling took %.2f s", runner.timings["kv_profile_s"])
        return blocks
    if cuda:  # a size was given: no profiling, but its forward still compiles the prefill kernels
        _compile_pass_without_profiling(runner)
    if cc.num_blocks is not None:
        return cc.num_blocks
    gib = cc.kv_cache_memory if cc.kv_cache_memory is not None else _DEFAULT_CPU_KV_GIB
    return max(2, int(gib * (1 << 30)) // runner.bytes_per_block)


@torch.inference_mode()
def _compile_pass_without_profiling(runner: ModelRunner) -> None:
    """Profiling's passes where the KV pool's size is given: the kernels only prefill steps
    launch (decode and piecewise capture never run attention over a prompt) compile now, not
    at the first request, where they would stall it for as long as compiling takes."""
    n = runner.config.scheduler_config.max_num_batched_tokens
    compile_ahead(lambda: compile_pass(runner, n), "start-up", runner.kernel_config.compile_ahead)
    dummy_forward(runner, n)
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()  # the forward's activations, out of the given pool's way


@torch.inference_mode()
def _profile_cuda_blocks(runner: ModelRunner) -> int:
    """Run a maximal batch without a KV pool, then give the pool what utilisation allows."""
    n = runner.config.scheduler_config.max_num_batched_tokens
    compile_ahead(
        lambda: compile_pass(runner, n),
        "KV profiling and decode-graph capture",
        runner.kernel_config.compile_ahead,
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    dummy_forward(runner, n)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device)
    free, total = torch.cuda.mem_get_info(runner.device)
    used_by_others = total - free - torch.cuda.memory_reserved(runner.device)
    budget = total * runner.config.cache_config.gpu_memory_utilization - peak - used_by_others
    blocks = int(budget // runner.bytes_per_block)
    if blocks < 2:
        raise ValueError(
            f"gpu_memory_utilization: no room for the KV cache (peak {peak / 2**30:.1f} GiB "
            f"of {total / 2**30:.1f} GiB); raise it or lower max_num_batched_tokens."
        )
    return blocks


def compile_pass(runner: ModelRunner, num_tokens: int) -> None:
    """Profiling's step, then the decode graphs' dry-run steps over a scratch cache: under
    ``compile_ahead`` their Triton variants compile in one parallel batch, before profiling
    (capture's own compile-ahead then finds them compiled)."""
    dummy_forward(runner, num_tokens)
    if runner.attn_backend.name != "triton" or runner.config.enforce_eager:
        return
    forward = functools.partial(decode_logits, runner, kv_caches=_scratch_cache(runner))
    sizes = capture_sizes(decode_graph_rows(runner.config))
    args = (runner.max_blocks, runner.block_size, runner.max_model_len, runner.device)
    DecodeGraphs(forward, sizes, *args, kernel_config=runner.kernel_config).dry_run()


def _scratch_cache(runner: ModelRunner) -> list[torch.Tensor]:
    """A one-block KV cache per layer."""
    mc = runner.config.model_config
    shape = (2, 1, runner.block_size, runner.num_kv_heads, mc.head_dim)
    return [
        torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device)
        for _ in range(mc.num_layers)
    ]


def dummy_forward(runner: ModelRunner, num_tokens: int) -> None:
    """A maximal step against a one-block scratch cache: one request with a block-long
    prompt (so the prefill kernels compile now, not at the first request) and single-token
    decode rows for the rest of the budget."""
    scratch = _scratch_cache(runner)
    q_len = min(runner.block_size, num_tokens)
    lens = [q_len] + [1] * (num_tokens - q_len)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    n_reqs, dev = len(lens), runner.device
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    pos = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    pos[:q_len] = torch.arange(q_len, device=dev)
    meta = AttentionMetadata.build(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.zeros(n_reqs, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.cat(
            [pos[:q_len], torch.zeros(num_tokens - q_len, dtype=torch.long, device=dev)]
        ),
        max_query_len=q_len,
        max_seq_len=q_len,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    hidden = runner.model(ids, pos, scratch, meta)
    logits = runner.model.compute_logits(hidden[: runner.config.scheduler_config.max_num_seqs])
    runner.sampling.warm(logits)  # its variants compile with the rest
    logits.float()  # the sorting sampler's copy, for the peak


# -- CUDA graphs ------------------------------------------------------------------------------


def decode_logits(
    runner: ModelRunner,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,
    kv_caches: list[torch.Tensor] | None = None,  # None: the KV pool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode graphs' forward: logits and their greedy ids."""
    caches = runner.kv_caches if kv_caches is None else kv_caches
    logits = runner.model.compute_logits(runner.model(input_ids, positions, caches, meta))
    return logits, greedy_argmax(logits, out, runner.kernel_config)


def decode_graph_rows(config: EngineConfig) -> int:
    """Rows of the largest decode step: ``max_num_seqs``, or with n-gram / suffix speculation
    the verify steps' ``1 + num_speculative_tokens`` rows per request, up to
    ``disable_by_batch_size`` requests (they replay the decode graphs too)."""
    n = config.scheduler_config.max_num_seqs
    spec = config.speculative_config
    if spec is None or spec.method == "draft_model":
        return n
    return max(n, min(n, spec.disable_by_batch_size) * (1 + spec.num_speculative_tokens))


def capture_graphs(runner: ModelRunner, emulate: bool = False) -> None:
    """Capture decode graphs for every bucket up to ``decode_graph_rows`` (capped at 512).

    ``emulate`` replays by re-running the forward (checks the padding logic off CUDA)."""
    if runner.attn_backend.name != "triton":
        logger.info("CUDA graphs need the triton attention backend; running eagerly.")
        return
    # the sampler runs after each replay: compiled now too (found compiled when KV profiling
    # ran; the LM head of a zero row gives logits of the serving dtype and width)
    hidden = torch.zeros(1, runner.config.model_config.hf_config.hidden_size, device=runner.device)
    logits = runner.model.compute_logits(hidden.to(runner.dtype))
    kc = runner.kernel_config
    in_graph = kc.sample_in_graph and kc.fused_sampler and use_triton(logits, kc)
    forward = functools.partial(decode_logits, runner)
    rows = decode_graph_rows(runner.config)
    graphs = new_decode_graphs(runner, forward, emulate, rows, sample_in_graph=in_graph)
    warm = functools.partial(runner.sampling.warm, logits)
    compile_ahead(warm, "the sampler", runner.kernel_config.compile_ahead)
    runner.sampling.warm(logits)
    note = lambda: (  # noqa: E731
        f" (eager warm-ups {graphs.warmup_time:.2f} s; {graphs.compiled_in_loop} Triton "
        "variants compiled in the capture loop)"
    )
    if _capture(runner, graphs, "decode", "batch sizes", "graph_capture_s", note):
        runner.graphs = graphs
    if runner.lora is not None:  # the same buckets with the adapters' path, for steps that use them
        ctx = runner.lora

        def lora_logits(*args, **kwargs):  # noqa: ANN202 - decode_logits' signature
            ctx.graph_mode = True  # the LoRA layers take the static-slot path
            try:
                return decode_logits(runner, *args, **kwargs)
            finally:
                ctx.graph_mode = False

        lora = new_decode_graphs(runner, lora_logits, emulate, rows, sample_in_graph=in_graph)
        if _capture(runner, lora, "LoRA decode", "batch sizes", "lora_graph_capture_s", lambda: ""):
            runner.lora_graphs = lora


def capture_piecewise(runner: ModelRunner, emulate: bool = False) -> None:
    """Capture prefill/mixed steps of up to ``piecewise_graph_max_tokens`` tokens as segment
    graphs around attention (``emulate``: replays re-run the segments, off CUDA)."""
    body = getattr(runner.model, "model", None)
    if runner.attn_backend.name != "triton" or not hasattr(body, "segment"):
        logger.info("Piecewise CUDA graphs need the triton backend and a segmented model.")
        return
    most = runner.config.scheduler_config.max_num_batched_tokens  # no step has more tokens
    sizes = token_buckets(min(runner.config.piecewise_graph_max_tokens, most))
    mc = runner.config.model_config
    pw = PiecewiseGraphs(
        body,
        runner.kv_caches,
        sizes,
        runner.num_heads,
        mc.head_dim,
        runner.dtype,
        runner.device,
        emulate=emulate,
    )
    note = lambda: f" ({len(pw.graphs[pw.sizes[0]])} segments each)"  # noqa: E731
    if _capture(runner, pw, "piecewise prefill", "token counts", "piecewise_capture_s", note):
        runner.piecewise = pw


def _capture(
    runner: ModelRunner,
    graphs: DecodeGraphs | PiecewiseGraphs,
    what: str,
    unit: str,
    timing: str,
    note: Callable[[], str],
) -> bool:
    """Capture ``graphs``, record the seconds in ``runner.timings[timing]`` and log them (with
    ``note()``, read after the capture); False if it failed (an optimisation: those steps stay
    eager)."""
    cuda = runner.device.type == "cuda"
    if cuda:  # the eager warm-ups' cached blocks are not the graphs' memory
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(runner.device) if cuda else 0
    try:
        dt = graphs.capture()
    except RuntimeError as e:
        logger.warning("CUDA graph capture (%s) failed (%s); running eagerly.", what, e)
        return False
    runner.use_cuda_graphs = True
    runner.timings[timing] = dt
    if cuda:
        torch.cuda.empty_cache()
    added = torch.cuda.memory_reserved(runner.device) - before if cuda else 0
    runner.graph_memory[what] = added
    sizes = graphs.sizes
    logger.info(
        "Captured %s graphs for %d %s %d..%d in %.2f s, %.0f MiB%s",
        what,
        len(sizes),
        unit,
        sizes[0],
        sizes[-1],
        dt,
        added / 2**20,
        note(),
    )
    return True
