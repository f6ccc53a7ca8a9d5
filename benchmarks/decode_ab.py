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

# KernelConfig fields a setting may set: knob -> (section or None, field). Each graph is
# captured with the runner's KernelConfig at its defaults except the fields its setting names.
KNOBS = {
    "order_min_reqs": ("attention", "order_min_reqs"),
    "fuse_rope_kv": ("attention", "fuse_rope_kv"),
    "pdl": ("pdl", "enabled"),
    "early_waves": ("pdl", "early_max_waves"),
    "pre_release": ("pdl", "pre_release"),
    "gemv_max_m": ("gemv", "max_m"),
    "fuse_silu": ("gemv", "fuse_silu"),
    "fuse_rope": ("gemv", "fuse_rope"),
    "pre_wait": ("attention", "pre_wait_max_reqs"),
    "split_early": ("attention", "split_early"),
    "argmax_kernel": (None, "argmax_kernel"),
    "norm_weight_first": (None, "rmsnorm_weight_first"),
    "max_splits": ("attention", "max_splits"),
    "min_split": ("attention", "min_split_tokens"),
}
_CUBLAS = {"gemv_max_m": 0}  # the linear layers on cuBLAS at every batch size
_GEMV = {"gemv_max_m": 1}  # batch 1's linear layers on the Triton GEMV
SETTINGS: dict[str, dict] = {  # name: knob values ("blas": torch's preferred BLAS library)
    "cublas": {**_CUBLAS, "pdl": False},
    "cublas+pdl": {**_CUBLAS, "pdl": True},
    "cublaslt+pdl": {**_CUBLAS, "pdl": True, "blas": "cublaslt"},
    "cublas+pdl request-order": {**_CUBLAS, "pdl": True, "order_min_reqs": 10**9},
    "cublas+pdl unfused-rope": {**_CUBLAS, "pdl": True, "fuse_rope_kv": False},
    "gemv+pdl": {**_GEMV, "pdl": True},
    "gemv": {**_GEMV, "pdl": False},
    # every Triton grid, however large, releases the next kernel right after its wait
    "gemv+pdl early-all": {**_GEMV, "pdl": True, "early_waves": 10**9},
    # decode attention split at most 16 / 8 / 4 ways (batch 1 takes 32 by default)
    "gemv+pdl splits16": {**_GEMV, "pdl": True, "max_splits": 16},
    "gemv+pdl splits8": {**_GEMV, "pdl": True, "max_splits": 8},
    "gemv+pdl splits4": {**_GEMV, "pdl": True, "max_splits": 4},
    "gemv+pdl early-all splits16": {**_GEMV, "pdl": True, "early_waves": 10**9, "max_splits": 16},
    # decode attention splits of at least 128 / 256 / 512 tokens
    "gemv+pdl minsplit128": {**_GEMV, "pdl": True, "min_split": 128},
    "gemv+pdl minsplit256": {**_GEMV, "pdl": True, "min_split": 256},
    "gemv+pdl minsplit512": {**_GEMV, "pdl": True, "min_split": 512},
    # SiLU-and-mul in the gate_up GEMV's epilogue (on by default) or as its own kernel
    "gemv+pdl silufuse": {**_GEMV, "pdl": True, "fuse_silu": True},
    "gemv+pdl nosilufuse": {**_GEMV, "pdl": True, "fuse_silu": False},
    "gemv+pdl noropefuse": {**_GEMV, "pdl": True, "fuse_rope": False},
    "gemv+pdl noprewait": {**_GEMV, "pdl": True, "pre_wait": 0},
    "gemv+pdl nosplitearly": {**_GEMV, "pdl": True, "split_early": False},
    "gemv+pdl noargmaxkernel": {**_GEMV, "pdl": True, "argmax_kernel": False},
    "gemv+pdl normweightlate": {**_GEMV, "pdl": True, "norm_weight_first": False},
    "gemv+pdl noropefuse noprewait": {**_GEMV, "pdl": True, "fuse_rope": False, "pre_wait": 0},
    # small grids (and the GEMV) release the next kernel before their wait, or after it
    "gemv+pdl pre": {**_GEMV, "pdl": True, "pre_release": True},
    "gemv+pdl after-wait": {**_GEMV, "pdl": True, "pre_release": False},
    # every grid, however large, releases the next kernel before its wait
    "gemv+pdl pre-all": {**_GEMV, "pdl": True, "pre_release": True, "early_waves": 10**9},
}


def _graph_ms(runner, b: int, iters: int = 10) -> float:
    return g.replay_ms(g.capture_graph(lambda: runner.graphs._run_static(b)), iters)


def kernel_config_for(base, values: dict):
    """``base`` (a KernelConfig) with the knobs ``values`` names set."""
    changes: dict = {}
    for knob, value in values.items():
        if knob not in KNOBS:
            continue
        section, name = KNOBS[knob]
        if section is None:
            changes[name] = value
        else:
            changes.setdefault(section, {})[name] = value
    return base.replace(**changes)


def _ab(runner, b: int, rounds: int, names: list[str]) -> dict:
    import torch

    base = runner.kernel_config
    blas = torch.backends.cuda.preferred_blas_library()

    def apply(values: dict) -> None:
        runner.set_kernel_config(kernel_config_for(base, values))
        torch.backends.cuda.preferred_blas_library(values.get("blas", blas))

    times: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for name in names:
                apply({**SETTINGS[name], "blas": SETTINGS[name].get("blas", "cublas")})
                times.setdefault(name, []).append(_graph_ms(runner, b))
    finally:
        apply({"blas": blas})
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
