"""A/B of decode-step settings in one process: device time of a captured decode step under each
setting -- BLAS library (cuBLAS, cuBLASLt), decode program order (request order, longest context
first), programmatic dependent launch of the Triton kernels (``kernels/pdl.py``), rotary
fused with the KV write or not, and the batch-1 linear layers on the Triton GEMV
(``kernels/gemv.py``) or on cuBLAS -- for

    batch 1 at a 1,000-token context            (single-stream latency)
    batch 384 at contexts spread over 1,000-2,000  (the 1,000/1,000 steady state)
    batch 384 at contexts spread over 128-256      (the 128/128 steady state)

Each setting gets its own CUDA graph of the same step (static inputs as the last real step left
them); figures are the median of several timed replays, settings interleaved to share drift.

    python benchmarks/decode_ab.py [--batch 384] [--rounds 3] [--settings cublas cublas+pdl ...]
    (Llama-3.1-8B shape, dummy weights, bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402
from gpu_profile import _all_decoding, _step_until  # noqa: E402

SETTINGS = {  # name: (BLAS library, ORDER_MIN_REQS, PDL, rotary fused with the KV write,
    #                most rows of a linear layer that run the Triton GEMV)
    "cublas": ("cublas", 64, False, True, 0),
    "cublas+pdl": ("cublas", 64, True, True, 0),
    "cublaslt+pdl": ("cublaslt", 64, True, True, 0),
    "cublas+pdl request-order": ("cublas", 10**9, True, True, 0),
    "cublas+pdl unfused-rope": ("cublas", 64, True, False, 0),  # rotary, then reshape_and_cache
    "gemv+pdl": ("cublas", 64, True, True, 1),  # batch 1's linear layers on the Triton GEMV
    "gemv": ("cublas", 64, False, True, 1),
    # every Triton grid, however large, releases the next kernel right after its wait
    "gemv+pdl early-all": ("cublas", 64, True, True, 1),
    # decode attention split at most 16 / 8 ways (batch 1 takes 32 by default)
    "gemv+pdl splits16": ("cublas", 64, True, True, 1),
    "gemv+pdl splits8": ("cublas", 64, True, True, 1),
    "gemv+pdl early-all splits16": ("cublas", 64, True, True, 1),
    # decode attention splits of at least 128 / 256 / 512 tokens (MIN_SPLIT_TOKENS)
    "gemv+pdl minsplit128": ("cublas", 64, True, True, 1),
    "gemv+pdl minsplit256": ("cublas", 64, True, True, 1),
    "gemv+pdl minsplit512": ("cublas", 64, True, True, 1),
    "gemv+pdl splits4": ("cublas", 64, True, True, 1),
    # RMSNorm (+ residual add) fused into the one-row GEMV after it (gemv.FUSE_NORM)
    "gemv+pdl normfuse": ("cublas", 64, True, True, 1),
    # SiLU-and-mul fused into the down projection's GEMV (gemv.FUSE_SILU, bf16 weights)
    "gemv+pdl silufuse": ("cublas", 64, True, True, 1),
    "gemv+pdl normfuse silufuse": ("cublas", 64, True, True, 1),
    # decode attention tiles of 32 / 16 tokens at batch <= 4 (more working splits)
    "gemv+pdl attn-bn32": ("cublas", 64, True, True, 1),
    "gemv+pdl attn-bn16": ("cublas", 64, True, True, 1),
}


def _graph_ms(runner, b: int, iters: int = 10) -> float:
    return g.replay_ms(g.capture_graph(lambda: runner.graphs._run_static(b)), iters)


def _ab(runner, b: int, rounds: int, names: list[str]) -> dict:
    import torch

    import fulcrum.attention.triton_backend as tb
    import fulcrum.kernels.decode_attention as dm
    from fulcrum.kernels import gemv, pdl

    max_splits, min_split = dm.MAX_SPLITS, dm.MIN_SPLIT_TOKENS
    fuse_norm, fuse_silu, bn = gemv.FUSE_NORM, gemv.FUSE_SILU, dm.SMALL_BATCH_BLOCK_N

    lib0 = torch.backends.cuda.preferred_blas_library()
    default = (lib0, tb.ORDER_MIN_REQS, pdl.ENABLED, tb.FUSE_ROPE_KV, gemv.USE_MAX_M)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name in names:
            lib, tb.ORDER_MIN_REQS, pdl.ENABLED, tb.FUSE_ROPE_KV, gemv.USE_MAX_M = SETTINGS[name]
            pdl.EARLY_MAX_WAVES = 10**9 if "early-all" in name else 1
            gemv.FUSE_NORM = "normfuse" in name or fuse_norm
            gemv.FUSE_SILU = "silufuse" in name or fuse_silu
            dm.SMALL_BATCH_BLOCK_N = int(name.rsplit("attn-bn", 1)[1]) if "attn-bn" in name else bn
            dm.MAX_SPLITS = int(name.rsplit("splits", 1)[1]) if " splits" in name else max_splits
            dm.MIN_SPLIT_TOKENS = (
                int(name.rsplit("minsplit", 1)[1]) if "minsplit" in name else min_split
            )
            torch.backends.cuda.preferred_blas_library(lib)
            times.setdefault(name, []).append(_graph_ms(runner, b))
    torch.backends.cuda.preferred_blas_library(lib0)
    _, tb.ORDER_MIN_REQS, pdl.ENABLED, tb.FUSE_ROPE_KV, gemv.USE_MAX_M = default
    pdl.EARLY_MAX_WAVES, dm.MAX_SPLITS, dm.MIN_SPLIT_TOKENS = 1, max_splits, min_split
    gemv.FUSE_NORM, gemv.FUSE_SILU, dm.SMALL_BATCH_BLOCK_N = fuse_norm, fuse_silu, bn
    return {k: round(statistics.median(v), 4) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=384, help="second batch size (0: batch 1 only)")
    ap.add_argument("--rounds", type=int, default=3, help="timed replays per setting")
    ap.add_argument("--ctx", type=int, default=1000, help="the single request's context")
    ap.add_argument(
        "--fp8", action="store_true", help="FP8 weights and KV cache (--quantization fp8)"
    )
    ap.add_argument(
        "--settings",
        nargs="+",
        default=list(SETTINGS),
        choices=list(SETTINGS),
        help="settings to compare, each with its own captured graph",
    )
    args = ap.parse_args()
    from fulcrum import LLM, SamplingParams

    engine = dict(g.ENGINE, quantization="fp8", kv_cache_dtype="fp8") if args.fp8 else g.ENGINE
    llm = LLM(g.MODEL, **engine)
    core = llm.core
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    def add(n_in: int) -> None:
        llm._add([rng.randrange(1000, 120000) for _ in range(n_in)], sp)

    res = {}
    add(args.ctx)
    _step_until(core, lambda: _all_decoding(core, 2))
    res[f"batch_1_ctx_{args.ctx}_ms"] = _ab(core.runner, 1, args.rounds, args.settings)
    print(json.dumps(res), flush=True)
    core.abort_requests(list(core.scheduler.requests))
    _step_until(core, lambda: not core.has_unfinished_requests())

    if not args.batch:
        return
    for _ in range(args.batch):
        add(rng.randrange(1000, 2000))
    _step_until(
        core,
        lambda: (
            len(core.scheduler.running) == args.batch
            and all(r.num_output_tokens > 2 for r in core.scheduler.running)
        ),
    )
    res[f"batch_{args.batch}_ctx_1000_2000_ms"] = _ab(
        core.runner, args.batch, args.rounds, args.settings
    )
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
