"""Microbenchmark of the Triton attention kernels at Llama-3.1-8B shapes (one layer).

Decode is bandwidth bound: each step reads every cached K/V row of the batch once, so the figure
of merit is KV bytes read / time, against the device's copy bandwidth (H200: ~4.28 TB/s).
Prefill is compute bound: reported as causal attention TFLOP/s.

    PYTHONPATH=src python benchmarks/kernels_bench.py [--ctx 1000 2000] [--splits 1 2 4 8]
    PYTHONPATH=src python benchmarks/kernels_bench.py --batch 384 --ctx 1500 --kv-cache fp8 \
        --decode-configs 64,2,3 128,4,3,128 (block_n,num_warps,num_stages[,maxnreg])
    PYTHONPATH=src python benchmarks/kernels_bench.py --batch 1 --ctx 1000 --kv-cache fp8 \
        --prefill 1024 8192 --prefill-configs 128,128,8,5 64,64,4,3 (block_m,block_n,warps,stages)
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

import fulcrum.kernels.decode_attention as decode_mod
import fulcrum.kernels.prefill_attention as prefill_mod
from fulcrum.kernels.decode_attention import (
    FP8_GPU_CONFIG,
    GPU_CONFIG,
    DecodeWorkspace,
    decode_attention,
    default_num_splits,
)
from fulcrum.kernels.prefill_attention import prefill_attention
from fulcrum.kernels.reshape_and_cache import reshape_and_cache

HQ, HKV, D, PAGE = 32, 8, 128, 16


def _paged(
    batch: int, ctx: int, dtype: torch.dtype, layout: str = "nhd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding ``batch`` contexts of ``ctx`` tokens in shuffled blocks, and its table.
    ``layout`` is how a block lies in memory; the kernels always see [.., page, heads, D]."""
    per_req = (ctx + PAGE - 1) // PAGE
    num_blocks = batch * per_req
    if layout == "hnd":  # each head's page contiguous; the kernels read it through strides
        cache = torch.randn(2, num_blocks, HKV, PAGE, D, device="cuda", dtype=dtype)
        cache = cache.permute(0, 1, 3, 2, 4)
    else:
        cache = torch.randn(2, num_blocks, PAGE, HKV, D, device="cuda", dtype=dtype)
    table = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, per_req)
    return cache, table


def bench_decode(
    batch: int,
    ctx: int,
    splits: list[int | None],
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    spread: float = 0.0,  # contexts uniform in ctx * [1 - spread, 1 + spread]
    orders: list[str] | None = None,  # program orders to compare (None: request order only)
    layout: str = "nhd",
) -> None:
    cache, table = _paged(batch, int(ctx * (1 + spread)) + PAGE, dtype, layout)
    if kv_dtype != cache.dtype:  # convert keeping the layout (``.to`` of a permuted view does)
        cache = torch.empty_like(cache, dtype=kv_dtype).copy_(cache)
    g = torch.Generator().manual_seed(0)
    lo = int(ctx * (1 - spread)) if spread else ctx
    seq_lens = torch.randint(max(1, lo), ctx + 1, (batch,), generator=g)
    if spread:  # odd rows mirror even ones about ctx: mean ctx, range ctx * (1 -+ spread)
        seq_lens = torch.where(torch.arange(batch) % 2 == 0, seq_lens, 2 * ctx - seq_lens)
        seq_lens = seq_lens.clamp(max=(ctx * (1 + spread) + PAGE - 1) // PAGE * PAGE)
    seq_lens = seq_lens.to(torch.int32).cuda()
    q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    kv_bytes = int(seq_lens.sum()) * 2 * HKV * D * cache.element_size()
    perms = {"request": None, "longest-first": torch.argsort(seq_lens, descending=True)}
    ws = DecodeWorkspace()
    # Warm-up: compile and let the clocks ramp before the first timed config.
    triton.testing.do_bench(
        lambda: decode_attention(q, cache, table, seq_lens, D**-0.5, out=out, workspace=ws),
        warmup=200,
        rep=200,
    )
    for s, order in ((s, o) for s in splits for o in (orders or ["request"])):
        n = s if s is not None else default_num_splits(batch, HKV, q.device)
        ms = triton.testing.do_bench(
            lambda n=n, order=perms[order]: decode_attention(
                q, cache, table, seq_lens, D**-0.5, out=out, num_splits=n, workspace=ws, order=order
            ),
            warmup=50,
            rep=300,
        )
        tag = f"{n}{'*' if s is None else ''}" + (f" {order}" if orders else "")
        cfg = FP8_GPU_CONFIG if kv_dtype == torch.float8_e4m3fn else GPU_CONFIG
        print(
            f"decode  B={batch:<3d} ctx={ctx:<5d} kv={str(kv_dtype)[6:]:<13s} splits={tag:<4s} "
            f"bn={cfg['block_n']} w={cfg['num_warps']} st={cfg['num_stages']} "
            f"r={cfg.get('maxnreg') or '-'} {ms * 1e3:8.1f} us  "
            f"{kv_bytes / ms / 1e6:7.0f} GB/s  (KV {kv_bytes / 1e6:.0f} MB)"
        )


def bench_prefill(num_tokens: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Causal attention of one ``num_tokens`` prompt, and the write of its K/V into the cache."""
    cache, table = _paged(1, num_tokens, dtype)
    cache = cache.to(kv_dtype)
    q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=dtype)
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ms = triton.testing.do_bench(
        lambda: prefill_attention(q, cache, table, seq_lens, qsl, num_tokens, D**-0.5, out=out),
        warmup=20,
        rep=200,
    )
    flops = 4 * HQ * D * num_tokens * num_tokens / 2  # QK^T and PV, causal half
    kv = str(kv_dtype)[6:]
    print(
        f"prefill T={num_tokens:<5d} kv={kv:<13s} {ms * 1e3:8.1f} us  "
        f"{flops / ms / 1e9:7.1f} TFLOP/s"
    )
    k, v = (torch.randn(num_tokens, HKV, D, device="cuda", dtype=dtype) for _ in "kv")
    slots = (table.flatten().long()[:, None] * PAGE + torch.arange(PAGE, device="cuda")).flatten()
    slots = slots[:num_tokens].contiguous()
    ms = triton.testing.do_bench(lambda: reshape_and_cache(k, v, cache, slots), rep=100)
    moved = 2 * num_tokens * HKV * D * (k.element_size() + cache.element_size())
    print(
        f"cache write T={num_tokens:<5d} kv={kv:<13s} {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes")
    p.add_argument("--ctx", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--splits", type=int, nargs="*", default=[], help="also time these counts")
    p.add_argument("--prefill", type=int, nargs="*", default=[2048], help="prompt lengths")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--kv-cache", choices=["auto", "fp8"], default="auto", help="KV-cache dtype")
    p.add_argument(
        "--ctx-spread",
        type=float,
        default=0.0,
        help="contexts uniform in ctx * [1 - s, 1 + s] instead of all equal to ctx",
    )
    p.add_argument(
        "--orders",
        nargs="*",
        default=[],
        choices=["request", "longest-first"],
        help="decode program orders to compare (longest-first: programs sorted by context)",
    )
    p.add_argument(
        "--layout",
        choices=["nhd", "hnd"],
        nargs="+",
        default=["nhd"],
        help="cache block layouts to compare: nhd = [page, heads, D] (fulcrum's), hnd = [heads, page, D]",
    )
    p.add_argument(
        "--fp8-modes",
        nargs="*",
        default=[],
        choices=list(decode_mod.FP8_MODES),
        help="with --kv-cache fp8: decode tile paths to compare (default: the kernel's own)",
    )
    p.add_argument(
        "--decode-configs",
        nargs="*",
        default=[],
        help="decode launch configs to sweep, each block_n,num_warps,num_stages[,maxnreg]",
    )
    p.add_argument(
        "--prefill-configs",
        nargs="*",
        default=[],
        help="prefill launch configs to sweep, each block_m,block_n,num_warps,num_stages",
    )
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache == "fp8" else dtype
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  (* = default splits)")
    configs = [tuple(int(x) for x in c.split(",")) for c in args.decode_configs] or [None]
    launch = FP8_GPU_CONFIG if args.kv_cache == "fp8" else GPU_CONFIG
    default = dict(launch)
    mode0 = decode_mod.FP8_MODE
    for layout, mode in ((lay, m) for lay in args.layout for m in args.fp8_modes or [mode0]):
        decode_mod.FP8_MODE = mode
        print(f"layout {layout}" + (f", FP8 tile path: {mode}" if args.kv_cache == "fp8" else ""))
        for cfg in configs:
            launch.clear()
            launch.update(default)
            if cfg is not None:
                launch.update(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
                launch["maxnreg"] = cfg[3] if len(cfg) > 3 else None
            for batch, ctx in ((b, c) for b in args.batch for c in args.ctx):
                bench_decode(
                    batch,
                    ctx,
                    [None, *args.splits],
                    dtype,
                    kv_dtype,
                    args.ctx_spread,
                    args.orders,
                    layout,
                )
    launch.clear()
    launch.update(default)
    decode_mod.FP8_MODE = mode0
    fp8 = kv_dtype == torch.float8_e4m3fn
    launch = prefill_mod.FP8_GPU_CONFIG if fp8 else prefill_mod.GPU_CONFIG
    default = dict(launch)
    for cfg in [tuple(int(x) for x in c.split(",")) for c in args.prefill_configs] or [None]:
        if cfg is not None:
            launch.update(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
        print(f"prefill config {launch}")
        widths = (True, False) if fp8 and cfg is None else (True,)
        for t, widen16 in ((t, w) for t in args.prefill for w in widths):
            prefill_mod.FP8_TO_FP16 = widen16
            if fp8:
                print(f"FP8 tiles widened to {'fp16' if widen16 else args.dtype}")
            bench_prefill(t, dtype, kv_dtype)
        launch.update(default)
    prefill_mod.FP8_TO_FP16 = True


if __name__ == "__main__":
    main()
