"""Host time per launch of each op of a batch-1 decode layer (Llama-3.1-8B shapes, bf16): what
an eager step (a prefill or mixed step, no CUDA graph) costs the CPU. Each op is called in a loop
of ``--iters`` launches without synchronising; the GPU work of each is a few microseconds, so the
loop runs at the host's launch rate. Compares programmatic dependent launch on and off.

    PYTHONPATH=src python benchmarks/launch_overhead.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fulcrum.config import PdlConfig
from fulcrum.kernels.activation import silu_and_mul
from fulcrum.kernels.decode_attention import DecodeWorkspace, decode_attention
from fulcrum.kernels.reshape_and_cache import reshape_and_cache
from fulcrum.kernels.rmsnorm import fused_add_rms_norm
from fulcrum.kernels.rotary import apply_rotary

HQ, HKV, D, PAGE, HIDDEN, INTER = 32, 8, 128, 16, 4096, 14336


def host_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000, help="launches per op")
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w_norm = torch.ones(HIDDEN, device=dev, dtype=dt)
    w_qkv = torch.randn((HQ + 2 * HKV) * D, HIDDEN, device=dev, dtype=dt)
    qkv = torch.randn(1, (HQ + 2 * HKV) * D, device=dev, dtype=dt)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(1, HQ, D), k.view(1, HKV, D), v.view(1, HKV, D)
    pos = torch.zeros(1, dtype=torch.int64, device=dev)
    cos_sin = torch.randn(4096, D, device=dev, dtype=torch.float32)
    cache = torch.zeros(2, 64, PAGE, HKV, D, device=dev, dtype=dt)
    slots = torch.tensor([5], dtype=torch.int64, device=dev)
    table = torch.arange(64, dtype=torch.int32, device=dev).view(1, 64)
    seq_lens = torch.tensor([1000], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    ws = DecodeWorkspace()
    gu = torch.randn(1, 2 * INTER, device=dev, dtype=dt)
    # each op under a PDL policy ``c`` (the kernels take it as an argument)
    ops = {
        "fused_add_rms_norm (Triton)": lambda c: fused_add_rms_norm(x, res, w_norm, 1e-5, c),
        "qkv linear (cuBLAS)": lambda c: F.linear(x, w_qkv),
        "rotary (Triton)": lambda c: apply_rotary(q, k, pos, cos_sin, pdl_cfg=c),
        "reshape_and_cache (Triton)": lambda c: reshape_and_cache(k, v, cache, slots, c),
        "decode_attention split+reduce (Triton)": lambda c: decode_attention(
            q,
            cache,
            table,
            seq_lens,
            D**-0.5,
            query_start_loc=qsl,
            out=out,
            workspace=ws,
            pdl_cfg=c,
        ),
        "silu_and_mul (Triton)": lambda c: silu_and_mul(gu, c),
        "torch.empty": lambda c: torch.empty(1, HIDDEN, device=dev, dtype=dt),
        "x + res (torch)": lambda c: x + res,
    }
    print(f"device: {torch.cuda.get_device_name()}  host us per call, {args.iters} calls")
    for name, fn in ops.items():
        row = []
        for on in (False, True):
            cfg = PdlConfig(enabled=on)
            row.append(host_us(lambda fn=fn, cfg=cfg: fn(cfg), args.iters))
        print(f"{name:42s} pdl off {row[0]:7.1f} us   pdl on {row[1]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
