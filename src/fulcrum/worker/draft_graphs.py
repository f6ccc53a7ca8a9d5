"""CUDA graphs for the draft model's one-token-per-request passes (every pass after the first,
and the first in a pure-decode step): the decode-graph machinery (``worker/cuda_graph.py``) over
the draft's forward and KV cache, one graph per batch bucket. A failed capture leaves those
passes eager."""

from __future__ import annotations

import logging

from fulcrum.worker.cuda_graph import DecodeForward, DecodeGraphs, capture_sizes
from fulcrum.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def new_decode_graphs(
    runner: ModelRunner,
    forward: DecodeForward,
    emulate: bool,
    max_rows: int | None = None,
    sample_in_graph: bool = False,
) -> DecodeGraphs:
    """Decode graphs (not captured yet) of ``forward`` for batch buckets up to ``max_rows``
    (default: ``max_num_seqs``; capped at ``MAX_CAPTURE_SIZE``); ``sample_in_graph``: they end
    with the sort-free sampler (the target model's; a draft's guesses are drawn elsewhere)."""
    return DecodeGraphs(
        forward,
        capture_sizes(max_rows or runner.config.scheduler_config.max_num_seqs),
        runner.max_blocks,
        runner.block_size,
        runner.max_model_len,
        runner.device,
        emulate=emulate,
        kernel_config=runner.kernel_config,
        sample_in_graph=sample_in_graph,
    )


def capture_draft_graphs(runner: ModelRunner, emulate: bool = False) -> None:
    """Capture the draft's decode graphs (``emulate``: replays re-run the forward, off CUDA).
    Needs the draft's KV cache allocated and the triton attention backend."""
    draft = runner.draft
    if draft is None:
        return
    if draft.attn_backend.name != "triton":
        logger.info("Draft-model CUDA graphs need the triton attention backend; eager.")
        return
    graphs = new_decode_graphs(runner, draft.decode_logits, emulate)
    try:
        dt = graphs.capture()
    except RuntimeError as e:
        logger.warning("Draft-model CUDA graph capture failed (%s); its passes run eagerly.", e)
        return
    draft.graphs = graphs
    runner.timings["draft_graph_capture_s"] = dt
    sizes = graphs.sizes
    logger.info(
        "Captured draft-model decode graphs for %d batch sizes %d..%d in %.2f s",
        len(sizes), sizes[0], sizes[-1], dt,
    )  # fmt: skip
