"""End-to-end A/B on one machine, each variant in its own process, same workloads as
``gpu_h200.py`` (TTFT, 128/128 x 1,000, 1,000/1,000 x 1,000); a variant's switches are
``KernelConfig`` fields (``VARIANT_KERNEL_CONFIG``):

    new       the engine as it is
    base      decode programs in request order (not longest context first)
    cublaslt  the engine with torch's cuBLASLt preferred for the GEMMs
    nopdl     the engine without programmatic dependent launch of its Triton kernels
    nopw      the engine without piecewise CUDA graphs for prefill/mixed steps (eager)
    nogemv    the engine with batch 1's linear layers on cuBLAS (not the Triton GEMV)
    early     every Triton grid releases the next kernel early (PDL: before its wait, or after
              it with nopre's setting), not only small grids and the batch-1 GEMV
    splits<N>  decode attention split at most N ways (32 by default)
    combine<N>  up to N decode requests, the last split program combines the splits (no reduce
              kernel; attention.combine_max_reqs)
    minsplit<N>  decode attention splits of at least N tokens (attention.min_split_tokens)
    nosilu    SiLU-and-mul as its own kernel at batch 1 (gemv.fuse_silu off)
    norope    rotary + the K/V write as their own kernel at batch 1 (gemv.fuse_rope off)
    noprewait  decode attention at batch <= 4 reads its inputs after its PDL wait
              (attention.pre_wait_max_reqs = 0)
    noqknorm  Qwen3's q/k norms as their own kernels before rotary (attention.fuse_qk_norm off)
    nosplitearly  the decode split grid at batch <= 4 releases the reduce kernel at its exit
              (attention.split_early off)
    nographpatch  the previous step's sampled ids patched in by a launch before each decode
              graph replay, not by the graph's first kernel (graph_patch off)
    noargmax  the greedy argmax of a few rows on torch (argmax_kernel off)
    tile2048  qkv and o_proj's GEMV on the general bf16 tile (4, 2048, 4), not one K tile
              (gemv.launch)
    nopre     small Triton grids and the GEMV release the next kernel after their wait, not
              before it (pdl.pre_release off)
    sortsampler  every sampled batch on the sorting sampler (fused_sampler off)
    nographsample  sampled decode steps drawn by the sort-free sampler launched after the
              decode graph's replay, not inside the graph (sample_in_graph off)
    fp8       the engine with an FP8 KV cache
    fp8w      FP8 weights (dummy, one scale per row) and an FP8 KV cache, as ``gpu_h200.py
              --phase fp8w`` (its max_num_seqs of 512 unless --max-num-seqs)
    fp8wbytes  fp8w with one row's FP8 GEMV widening byte by byte (gemv.fp8_words off)
    fp8wnofq  fp8w with a separate per-token quantization before each FP8 GEMM (fuse_fp8_quant
              off; on by default: the norm and SiLU kernels write the GEMMs' FP8 rows)
    int4[swap][dense<N>]  INT4 weights (GPTQ g128, dummy) + FP8 KV cache; ``swap``: the W4A16
              GEMM with swapped operands, ``dense<N>``: from N rows dequantize + cuBLAS
              (kernel_config.int_gemm)
    fp8@64,4,7,128 / bf16@64,2,3   FP8 or bf16 KV cache with this decode launch config
              (block_n,num_warps,num_stages[,maxnreg])

    A variant joins switches with "+" onto a base (the first name): fp8w+combine4,
    int4dense256+norope.

    python benchmarks/throughput_ab.py [--order new base cublaslt fp8@64,4,7,128] [--skip-long]
        [--sections ttft,itl,128/128,1000/1000,1000/1000-sampled] [--max-num-batched-tokens 4096 8192]

Prints one RESULT line per measurement with its ``variant``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402

# The KernelConfig (as EngineArgs takes it) of each variant that changes a switch.
VARIANT_KERNEL_CONFIG: dict[str, dict] = {
    "base": {"attention": {"order_min_reqs": 10**9}},
    "nogemv": {"gemv": {"max_m": 0}},
    "early": {"pdl": {"early_max_waves": 10**9}},
    "nopre": {"pdl": {"pre_release": False}},
    "nosilu": {"gemv": {"fuse_silu": False}},
    "norope": {"gemv": {"fuse_rope": False}},
    "noprewait": {"attention": {"pre_wait_max_reqs": 0}},
    "nosplitearly": {"attention": {"split_early": False}},
    "noqknorm": {"attention": {"fuse_qk_norm": False}},
    "sortsampler": {"fused_sampler": False},
    "nographsample": {"sample_in_graph": False},
    "nographpatch": {"graph_patch": False},
    "noargmax": {"argmax_kernel": False},
    "nopdl": {"pdl": {"enabled": False}},
    "fp8wbytes": {"gemv": {"fp8_words": False}},
    "fp8wnofq": {"fuse_fp8_quant": False},
}


def _switches(name: str) -> dict:
    """The KernelConfig fields one variant name sets."""
    for prefix, field in (("splits", "max_splits"), ("minsplit", "min_split_tokens"),
                          ("combine", "combine_max_reqs")):  # fmt: skip
        if name.startswith(prefix) and name.removeprefix(prefix).isdigit():
            return {"attention": {field: int(name.removeprefix(prefix))}}
    return VARIANT_KERNEL_CONFIG.get(name, {})


def _merge(into: dict, extra: dict) -> dict:
    for key, val in extra.items():
        if isinstance(val, dict) and isinstance(into.get(key), dict):
            _merge(into[key], val)
        else:
            into[key] = val
    return into


def variant(name: str, sections: list[str], max_num_seqs: int | None, budget: int | None,
            model: str = g.MODEL) -> None:  # fmt: skip
    engine = dict(g.ENGINE)
    if max_num_seqs:
        engine["max_num_seqs"] = max_num_seqs
    if budget:
        engine["max_num_batched_tokens"] = budget
    full_name = name
    name, *extra = name.split("+")
    kind, _, cfg = name.partition("@")
    if kind == "fp8":
        engine["kv_cache_dtype"] = "fp8"
    if kind.startswith("fp8w"):  # FP8 weights + FP8 KV, the engine settings of gpu_h200's phase
        engine.update(g.FP8W["fp8w"]["engine"])
        if max_num_seqs:
            engine["max_num_seqs"] = max_num_seqs
    setup = g.FP8W.get(
        "fp8w" if kind.startswith("fp8w") else "int4w" if kind.startswith("int4") else ""
    )
    if setup is not None:  # the floors printed: that format's bytes per step
        g.WEIGHT_BYTES, g.KV_BYTES = setup["weight_bytes"], setup["kv_bytes"]
    if cfg:
        import fulcrum.kernels.decode_attention as da

        vals = [int(x) for x in cfg.split(",")]
        launch = da.FP8_GPU_CONFIG if kind == "fp8" else da.GPU_CONFIG
        launch.update(block_n=vals[0], num_warps=vals[1], num_stages=vals[2])
        launch["maxnreg"] = vals[3] if len(vals) > 3 else None
    kc: dict = {}
    for part in [name, *extra]:
        _merge(kc, _switches(part))
    if "nopw" in (name, *extra):
        engine["piecewise_graph_max_tokens"] = 0
    if kind.startswith("int4"):  # INT4 (GPTQ g128) + FP8 KV: int4[swap][dense<rows>]
        engine.update(quantization="gptq", kv_cache_dtype="fp8")
        rest = kind.removeprefix("int4")
        dense = rest.partition("dense")[2]
        kc["int_gemm"] = {"swap_ab": "swap" in rest, "dense_rows": int(dense or 0)}
    if name == "tile2048":
        from fulcrum.kernels import gemv

        kc["gemv"] = {"launch": {"bf16_small": gemv.GPU_CONFIG["bf16"]}}
    engine["kernel_config"] = kc
    if name == "cublaslt":
        import torch

        torch.backends.cuda.preferred_blas_library("cublaslt")
    from fulcrum import LLM

    llm = LLM(model if not g.SMOKE else g.MODEL, **engine)
    drv = g.Driver(llm)
    t_end = time.perf_counter() + 1e9
    drv.run(g.workload(8, 300, 16, 99), t_end)  # warm-up
    if "ttft" in sections:
        g.bench_prefill(drv, t_end)
    if "itl" in sections:
        g.bench_itl(drv, t_end)
    plan = [("128/128", 1000, 128, 128), ("1000/1000", 1000, 1000, 1000)]
    plan.append(("1000/1000-sampled", 1000, 1000, 1000))  # temperature 0.8, top-p 0.95
    for wl, n, n_in, n_out in (p for p in plan if p[0] in sections):
        sampling = g.SAMPLED if wl.endswith("sampled") else None
        r = drv.run(g.workload(n, n_in, n_out, 7), t_end, sampling)
        g.emit(
            "throughput",
            variant=full_name,
            max_num_seqs=engine["max_num_seqs"],
            max_num_batched_tokens=engine["max_num_batched_tokens"],
            workload=wl,
            **r,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--order", nargs="+", default=["new", "base"], help="variants to run, in this order"
    )
    ap.add_argument("--skip-long", action="store_true", help="leave out 1,000/1,000")
    ap.add_argument(
        "--sections",
        default="ttft,itl,128/128,1000/1000",
        help="comma-separated measurements to run in each variant",
    )
    ap.add_argument(
        "--max-num-seqs", type=int, help="engine's max_num_seqs for every variant (default 384)"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=[None],
        help="step token budgets to run each variant at (default: the engine's 8,192)",
    )
    ap.add_argument(
        "--model", default=g.MODEL, help="configs/ shape for every variant (floors stay the 8B's)"
    )
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if not (args.skip_long and s == "1000/1000")]
    if args.variant:
        return variant(
            args.variant, sections, args.max_num_seqs, args.max_num_batched_tokens[0], args.model
        )
    for budget in args.max_num_batched_tokens:
        for name in args.order:
            cmd = [sys.executable, __file__, "--variant", name, "--sections", ",".join(sections)]
            cmd += ["--model", args.model]
            cmd += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
            cmd += ["--max-num-batched-tokens", str(budget)] if budget else []
            print(f"== {name}" + (f", budget {budget}" if budget else ""), flush=True)
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
