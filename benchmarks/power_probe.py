"""Energy of a decode step's parts on CUDA: is a long run bound by the power cap, and which part
spends the energy?

A 1,000/1,000 run draws ~692 W, at the H200's 700 W cap, with the SM clock below its 1,980 MHz
maximum, so compute-bound work runs slower than the 790 TFLOP/s the floors assume. Each case
below is one CUDA graph replayed back to back for ``--seconds``; NVML's energy counter gives the
watts and joules per replay, and its clock reading the SM MHz held meanwhile (median):

    idle       nothing (the device's floor)
    read       one step's worth of KV bytes read by a reduction (HBM alone): torch's sum, and a
               Triton sum over 64 x 128 tiles, by pointer loads (readptr@warps,stages) or by
               the tensor memory accelerator (readtma@warps,stages)
    attn@cfg   a decode step's 32 attention calls (batch 384, contexts 1,000-2,000, longest
               first) at launch config block_n,num_warps,num_stages
    gemm<M>    a step's weight GEMMs at M rows (32 layers + the LM head)
    step@cfg   a decode step without its embedding: per layer norm, qkv, rotary + cache write,
               attention, o_proj, norm, gate_up, SiLU-and-mul, down; then the LM head

Where the reads and both GEMM cases ran (``--gemm-m`` with 8,576), it also prints the floor of
1,000 / 1,000 at the power cap (``workload_floor``): the cheapest read's joules per byte for
the KV, the GEMMs' joules per row, and NVML's enforced power limit.

    PYTHONPATH=src python benchmarks/power_probe.py [--attn-configs 64,2,3 128,4,3] [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_bench  # noqa: E402
import gpu_h200 as g  # noqa: E402

import fulcrum.kernels.decode_attention as da  # noqa: E402
from fulcrum.kernels.activation import silu_and_mul  # noqa: E402
from fulcrum.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402
from fulcrum.kernels.rotary import apply_rotary  # noqa: E402

HQ, HKV, D, PAGE, HIDDEN, INTER, VOCAB, LAYERS = 32, 8, 128, 16, 4096, 14336, 128256, 32


class Nvml:
    """The energy counter (mJ since the driver loaded) and the SM clock, through pynvml."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def energy_j(self) -> float:
        return self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1e3

    def mhz(self) -> int:
        return self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM)

    def cap_w(self) -> float:
        return self.nv.nvmlDeviceGetEnforcedPowerLimit(self.h) / 1e3


def workload_floor(
    read_j_per_byte: float,
    decode_gemm_j_per_row: float,
    prefill_gemm_j_per_token: float,
    cap_w: float,
    n_in: int = 1000,
    n_out: int = 1000,
) -> dict:
    """Seconds per request pair of the n_in / n_out workload, and output tok/s, if the device
    spends its whole power cap: a decode token reads its context's KV (mean n_in + n_out / 2
    tokens) at ``read_j_per_byte`` plus its row of a decode step's GEMMs; a prompt token costs
    its row of a prefill step's GEMMs less the LM head (prefill runs it on one row per prompt)."""
    layer = (HQ + 2 * HKV) * D * HIDDEN + HQ * D * HIDDEN + 3 * INTER * HIDDEN
    head_share = VOCAB * HIDDEN / (LAYERS * layer + VOCAB * HIDDEN)
    kv_bytes = 2 * LAYERS * HKV * D * 2  # per cached token, bf16
    e_dec = (n_in + n_out / 2) * kv_bytes * read_j_per_byte + decode_gemm_j_per_row
    e_pre = prefill_gemm_j_per_token * (1 - head_share)
    seconds = (n_out * e_dec + n_in * e_pre) / cap_w
    return {
        "cap_w": cap_w,
        "decode_token_mj": round(1e3 * e_dec, 2),
        "decode_token_us": round(1e6 * e_dec / cap_w, 1),
        "prompt_token_mj": round(1e3 * e_pre, 2),
        "prompt_token_us": round(1e6 * e_pre / cap_w, 1),
        "output_tok_s": round(n_out / seconds),
    }


def measure(nv: Nvml, name: str, graph, seconds: float) -> dict:
    """``graph`` replayed back to back for ``seconds``: ms, W, J per replay and SM MHz."""
    if graph is None:  # idle
        e0, t0 = nv.energy_j(), time.perf_counter()
        clocks = []
        while time.perf_counter() - t0 < seconds:
            clocks.append(nv.mhz())
            time.sleep(0.05)
        w = (nv.energy_j() - e0) / (time.perf_counter() - t0)
        r = {"case": name, "watts": round(w, 1), "sm_mhz": g._median(clocks)}
        print(r, flush=True)
        return r
    ms = g.replay_ms(graph, 3)
    reps = max(5, int(seconds * 1e3 / ms))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0, t0 = nv.energy_j(), time.perf_counter()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    clocks = []
    while not end.query():
        clocks.append(nv.mhz())
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    joules = nv.energy_j() - e0
    ms = start.elapsed_time(end) / reps
    r = {
        "case": name,
        "ms": round(ms, 3),
        "watts": round(joules / wall, 1),
        "joules_per_replay": round(joules / reps, 3),
        "sm_mhz": g._median(clocks),
        "replays": reps,
    }
    print(r, flush=True)
    return r


@triton.jit
def _read_kernel(x, desc, out, per_prog, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
    """Sums ``x`` [per_prog * programs * BM, BN] tile by tile over a persistent grid."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    offs_m, offs_n = tl.arange(0, BM), tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for i in range(per_prog):
        t = pid + i * nprog
        if TMA:
            tile = desc.load([t * BM, 0])
        else:
            tile = tl.load(x + (t * BM + offs_m)[:, None] * BN + offs_n[None, :])
        acc += tile.to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def triton_read(
    flat: torch.Tensor, tma: bool, warps: int, stages: int, bm: int = 64, bn: int = 128
):
    """A closure summing ``flat`` (its whole tiles) with :func:`_read_kernel`."""
    progs = 2 * torch.cuda.get_device_properties(flat.device).multi_processor_count
    per_prog = flat.numel() // (bm * bn * progs)
    x = flat[: per_prog * progs * bm * bn].view(per_prog * progs * bm, bn)
    desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(x, block_shape=[bm, bn])
    out = torch.empty(progs, device=x.device, dtype=torch.float32)

    def run():
        _read_kernel[(progs,)](
            x, desc if tma else x, out, per_prog, BM=bm, BN=bn, TMA=tma, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        return out

    return run


def attention_inputs(batch: int, ctx: int):
    """A paged cache of ``batch`` contexts spread over ctx * [2/3, 4/3] (mean ``ctx``), with its
    table, lengths, longest-first order and a query."""
    hi = ctx * 4 // 3
    per_req = -(-hi // PAGE)
    cache = torch.randn(2, batch * per_req, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * per_req, device="cuda").to(torch.int32).view(batch, per_req)
    lens = torch.linspace(ctx * 2 // 3, hi, batch, device="cuda").round().to(torch.int32)
    order = torch.argsort(lens, descending=True)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return cache, table, lens, order, q


def set_config(cfg: str) -> None:
    bn, w, st = (int(x) for x in cfg.split(","))
    da.GPU_CONFIG.update(block_n=bn, num_warps=w, num_stages=st)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=384, help="decode batch")
    p.add_argument("--ctx", type=int, default=1500, help="mean context of the decode batch")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each case's run")
    p.add_argument(
        "--attn-configs",
        nargs="+",
        default=[",".join(str(da.GPU_CONFIG[k]) for k in ("block_n", "num_warps", "num_stages"))],
        help="decode attention launch configs, each block_n,num_warps,num_stages",
    )
    p.add_argument(
        "--read-configs",
        nargs="*",
        default=["readptr@4,3", "readtma@4,3"],
        help="Triton read kernels: readptr or readtma @ num_warps,num_stages",
    )
    p.add_argument("--gemm-m", type=int, nargs="*", default=[384, 8576], help="GEMM row counts")
    p.add_argument("--blas", nargs="+", default=["cublas"], help="BLAS libraries for gemm<M>")
    p.add_argument("--cases", default="idle,read,attn,gemm,step", help="which cases to run")
    args = p.parse_args()
    cases = set(args.cases.split(","))
    nv = Nvml()
    bf16, b = torch.bfloat16, args.batch
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    results = []
    if "idle" in cases:
        torch.cuda.synchronize()
        time.sleep(1.0)
        results.append(measure(nv, "idle", None, 2.0))
    cache, table, lens, order, q = attention_inputs(b, args.ctx)
    out, ws = torch.empty_like(q), da.DecodeWorkspace()
    scale = D**-0.5
    if "read" in cases:
        nbytes = int(lens.sum()) * 2 * HKV * D * 2
        flat = cache.view(-1)[: nbytes // 2]
        graph = g.capture_graph(lambda: [flat.sum() for _ in range(LAYERS)])
        results.append(measure(nv, "read", graph, args.seconds))
        for cfg in args.read_configs:
            kind, _, ws_ = cfg.partition("@")
            warps, stages = (int(v) for v in ws_.split(","))
            fn = triton_read(flat, kind == "readtma", warps, stages)
            graph = g.capture_graph(lambda fn=fn: [fn() for _ in range(LAYERS)])
            results.append(measure(nv, cfg, graph, args.seconds))
        del graph
    default = dict(da.GPU_CONFIG)

    def attn():
        da.decode_attention(q, cache, table, lens, scale, out=out, workspace=ws, order=order)

    if "attn" in cases:
        for cfg in args.attn_configs:
            set_config(cfg)
            graph = g.capture_graph(lambda: [attn() for _ in range(LAYERS)])
            results.append(measure(nv, f"attn@{cfg}", graph, args.seconds))
            del graph
        da.GPU_CONFIG.update(default)

    def weights(n: int, k: int) -> torch.Tensor:
        # the engine's dummy weights: uniform in +-0.02
        return torch.empty(n, k, device="cuda", dtype=bf16).uniform_(-0.02, 0.02)

    w_qkv, w_o = weights((HQ + 2 * HKV) * D, HIDDEN), weights(HIDDEN, HIDDEN)
    w_gu, w_down, w_head = (
        weights(2 * INTER, HIDDEN),
        weights(HIDDEN, INTER),
        weights(VOCAB, HIDDEN),
    )
    if "gemm" in cases:
        for m in args.gemm_m:
            gemms, _ = gemm_bench.step_gemms(m, weights)
            for lib in args.blas:
                torch.backends.cuda.preferred_blas_library(lib)
                graph = g.capture_graph(gemms)
                results.append(measure(nv, f"gemm{m} {lib}", graph, args.seconds))
                del graph
            torch.backends.cuda.preferred_blas_library("cublas")
            del gemms
            torch.cuda.empty_cache()
    if "step" in cases:
        x = torch.randn(b, HIDDEN, device="cuda", dtype=bf16)
        res = torch.randn(b, HIDDEN, device="cuda", dtype=bf16)
        norm_w = torch.ones(HIDDEN, device="cuda", dtype=bf16)
        pos = lens.long() - 1
        cos_sin = torch.randn(8192, D, device="cuda", dtype=torch.float32)
        slots = (table[:, 0].long() * PAGE).contiguous()

        def step():
            h, r = x, res
            for _ in range(LAYERS):
                n, r = fused_add_rms_norm(h, r, norm_w, 1e-5)
                qkv = F.linear(n, w_qkv)
                qq, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
                qq, k = qq.view(b, HQ, D), k.view(b, HKV, D)
                apply_rotary(qq, k, pos, cos_sin, (v.view(b, HKV, D), cache, slots))
                attn()
                n, r = fused_add_rms_norm(F.linear(out.view(b, -1), w_o), r, norm_w, 1e-5)
                h = F.linear(silu_and_mul(F.linear(n, w_gu)), w_down)
            F.linear(h, w_head)

        for cfg in args.attn_configs:
            set_config(cfg)
            graph = g.capture_graph(step)
            results.append(measure(nv, f"step@{cfg}", graph, args.seconds))
            del graph
        da.GPU_CONFIG.update(default)
    print("RESULTS", results, flush=True)
    by = {r["case"]: r for r in results}
    reads = [r for r in results if r["case"].startswith("read")]
    dec, pre = by.get(f"gemm{b} cublas"), by.get("gemm8576 cublas")
    if reads and dec and pre:  # the 1,000 / 1,000 workload's floor at this device's power cap
        read_bytes = int(lens.sum()) * 2 * HKV * D * 2 * LAYERS
        j_byte = min(r["joules_per_replay"] for r in reads) / read_bytes
        floor = workload_floor(
            j_byte, dec["joules_per_replay"] / b, pre["joules_per_replay"] / 8576, nv.cap_w()
        )
        print("FLOOR 1000/1000 at the power cap", floor, flush=True)


if __name__ == "__main__":
    main()
