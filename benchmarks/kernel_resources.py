"""Compile the attention kernels for a GPU architecture on any host (no GPU needed) and report
what each launch config costs a multiprocessor: registers, spills, shared memory, how many K/V
tile buffers the software pipeline keeps (one is being read, the rest are loading), how many
programs fit per multiprocessor, and the instructions one thread issues per K/V tile (the main
loop's SASS, by opcode): a kernel that issues too many per byte is bound by issue, not memory.

    PYTHONPATH=src python benchmarks/kernel_resources.py --kernel decode --kv fp8 \
        --configs 64,2,6 128,4,5 64,4,5,96     (block_n,num_warps,num_stages[,maxnreg])

``--kernel gemv`` does the same for the batch-1 GEMV (``kernels/gemv.py``, one row of x, K =
4096) with ``--weight bf16|fp8|fp32`` and configs ``block_n,block_k,num_warps``, and reports the
K loop's warp instructions per weight byte against what Hopper can issue per byte at 4.28 TB/s
(132 SMs x 4 schedulers x 1.98 GHz / 4.28e12 B/s = 0.24). ``--kernel w4a16`` reports the same for
the W4A16 GEMV (``kernels/w4a16_gemv.py``, 4-bit weights, group 128).

Arguments are specialised the way Triton's launcher does at run time (pointers and strides
divisible by 16), or the loads would not be pipelined here while they are on the device.
Occupancy limits use Hopper's 64K registers and 227 KB of shared memory per multiprocessor.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fulcrum.kernels import decode_attention as decode_mod
from fulcrum.kernels import gemv as gemv_mod
from fulcrum.kernels import prefill_attention as prefill_mod
from fulcrum.kernels import w4a16_gemv as w4a16_gemv_mod

REGS_PER_SM, SMEM_PER_SM = 65536, 232448
UNSPECIALISED = {
    "scale_log2",
    "eps",
    "num_splits",
    "min_split",
    "stride_plh",
}  # floats and do_not_specialize args


def _compile(fn, pointers: dict[str, str], const: dict, arch: int, warps: int, stages: int, regs):
    names = fn.arg_names
    sig = {
        n: pointers.get(n)
        or ("constexpr" if n in const else "fp32" if n in ("scale_log2", "eps") else "i32")
        for n in names
    }
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if sig[n] != "constexpr" and n not in UNSPECIALISED
    }
    consts = {(names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages, maxnreg=regs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def _ptxas(ptx: str, arch: int) -> tuple[int, int, str]:
    """(registers per thread, spill-store bytes, SASS) from ptxas -v on the kernel's PTX."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as d:
        path, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(path, "w") as fh:
            fh.write(ptx)
        cmd = [os.path.join(bin_dir, "ptxas"), f"-arch=sm_{arch}a", "-v", path, "-o", cubin]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        dump = [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin]
        sass = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spill, sass


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop body (a backward branch's target up to the branch):
    the per-tile instruction cost of an attention kernel's K/V loop, for one thread."""
    ins = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    best: list[str] = []
    for addr, text in ins:
        m = re.search(r"\bBRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best
    )


def report(kernel: str, kv: str, cfg: tuple[int, ...], arch: int, pre_wait: bool = False) -> str:
    block_n, warps, stages = cfg[:3]
    maxnreg = cfg[3] if len(cfg) > 3 else None
    kv_ty = "fp8e4nv" if kv == "fp8" else "bf16"
    fp8 = kv == "fp8"
    common = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_D=128, BLOCK_N=block_n, PDL=0)
    if kernel == "decode":
        fn = decode_mod._decode_split_kernel
        pointers = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "qsl_ptr")}
        pointers |= dict(order_ptr="*i64", part_out_ptr="*fp32", part_lse_ptr="*fp32")
        mode = decode_mod.FP8_MODES[decode_mod.FP8_MODE] if fp8 else 0
        const = dict(
            common, SPLIT=pre_wait, BLOCK_G=16, PRECISION="tf32", COMPUTE=tl.bfloat16,
            FP8_MODE=mode, HAS_ORDER=not pre_wait, V_TOKEN_MAJOR=fp8, PRE_WAIT=pre_wait,
        )  # fmt: skip
    else:
        fn = prefill_mod._prefill_kernel
        pointers = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "work_ptr")}
        compute = tl.float16 if fp8 and prefill_mod.FP8_TO_FP16 else tl.bfloat16
        const = dict(common, BLOCK_M=128, BLOCK_Q=32, PRECISION="tf32", COMPUTE=compute)
        const["V_TOKEN_MAJOR"] = fp8
    pointers |= dict(q_ptr="*bf16", out_ptr="*bf16", k_cache_ptr=f"*{kv_ty}")
    pointers["v_cache_ptr"] = f"*{kv_ty}"
    k = _compile(fn, pointers, const, arch, warps, stages, maxnreg)
    ptx, ttgir, smem = k.asm["ptx"], k.asm["ttgir"], k.metadata.shared
    regs, spill, sass = _ptxas(ptx, arch)
    loop = main_loop(sass)
    # pipeline buffers: operand-less shared-memory allocations [stages, tile...] of K/V tiles
    allocs = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(?:\d+x)*128x", ttgir)
    bufs = sorted({int(m) for m in allocs})
    per_sm = min(REGS_PER_SM // (regs * 32 * warps), SMEM_PER_SM // max(smem, 1))
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
    return (
        f"{kernel:<7s} kv={kv:<4s} bn={block_n:<3d} w={warps} st={stages} "
        f"r={maxnreg or '-':<3}  regs {regs:3d}  spill {spill:4d} B  smem {smem / 1024:5.1f} KB  "
        f"K/V buffers {max(bufs) if bufs else 0}  programs/SM {per_sm}  "
        f"warps/SM {per_sm * warps:2d}  cp.async {'yes' if 'cp.async' in ptx else 'NO'}  {mma}\n"
        f"        K/V loop: {sum(loop.values())} instructions per thread per tile: "
        + ", ".join(f"{op} {n}" for op, n in loop.most_common(8))
    )


ISSUE_PER_BYTE = 132 * 4 * 1.98e9 / 4.28e12  # warp instructions Hopper issues per HBM byte


def report_gemv(
    weight: str, cfg: tuple[int, ...], arch: int, silu: bool = False, rope: bool = False
) -> str:
    block_n, block_k, warps = cfg
    words = weight == "fp8-words"  # the one-row path that reads int32 words of four e4m3
    weight = "fp8" if words else weight
    w_ty, elem = {"bf16": ("bf16", 2), "fp8": ("fp8e4nv", 1), "fp32": ("fp32", 4)}[weight]
    act = "fp32" if weight == "fp32" else "bf16"
    pointers = dict(x_ptr=f"*{act}", w_ptr=f"*{w_ty}", s_ptr="*fp32", b_ptr=f"*{act}")
    pointers |= dict(out_ptr=f"*{act}")
    const = dict(K=4096, HAS_SCALE=weight == "fp8", HAS_BIAS=False, BLOCK_M=1, PDL=0)
    const |= dict(SILU=silu, ROPE=rope, BLOCK_N=block_n, BLOCK_K=block_k, **gemv_mod._NO_ROPE)
    const |= dict(WORDS=words, FAST=words)
    if rope:  # the 8B's qkv with a bf16 cache
        pointers |= dict(pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64")
        pointers |= dict(kc_ptr=f"*{act}", vc_ptr=f"*{act}")
        const |= dict(HEAD_DIM=128, NUM_Q_HEADS=32, NUM_KV_HEADS=8, PAGE=16)
    k = _compile(gemv_mod._gemv_kernel, pointers, const, arch, warps, 1, None)
    regs, spill, sass = _ptxas(k.asm["ptx"], arch)
    loop = main_loop(sass)
    per_sm = REGS_PER_SM // (regs * 32 * warps)
    per_byte = sum(loop.values()) * warps / (block_n * block_k * elem)
    return (
        f"gemv    w={weight + ('-words' if words else ''):<4s} silu={int(silu)} rope={int(rope)} bn={block_n:<3d} "
        f"bk={block_k:<5d} w={warps}  regs {regs:3d}  "
        f"spill {spill:4d} B  programs/SM {per_sm}  warps/SM {per_sm * warps:2d}\n"
        f"        K loop: {sum(loop.values())} instructions per thread per tile, "
        f"{per_byte:.3f} warp instructions per weight byte (issue limit at full bandwidth "
        f"{ISSUE_PER_BYTE:.3f}): " + ", ".join(f"{op} {n}" for op, n in loop.most_common(8))
    )


def report_w4a16(
    cfg: tuple[int, ...], arch: int, bits: int = 4, group: int = 128, one_row: bool = True
) -> str:
    """The W4A16 GEMV (``kernels/w4a16_gemv.py``, one row of x, split-K partial sums) per weight
    byte: its K loop unpacks, dequantizes and accumulates each weight in registers."""
    block_n, block_k, warps = cfg
    pointers = dict(x_ptr="*bf16", qw_ptr="*i32", z_ptr="*u8", s_ptr="*bf16", m_ptr="*bf16")
    pointers |= dict(b_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
    const = dict(GROUP=group, BITS=bits, HAS_MIN=False, HAS_BIAS=False, SPLIT=2, BLOCK_M=1)
    const |= dict(BLOCK_N=block_n, BLOCK_K=block_k)
    if one_row:
        const.pop("BLOCK_M")
        const |= dict(PDL=0, FAST=True, **w4a16_gemv_mod.PLAIN_EPILOGUE)
        k = _compile(w4a16_gemv_mod._gemv1_kernel, pointers, const, arch, warps, 1, None)
    else:
        k = _compile(w4a16_gemv_mod._gemv_kernel, pointers, const, arch, warps, 1, None)
    regs, spill, sass = _ptxas(k.asm["ptx"], arch)
    loop = main_loop(sass)
    per_sm = REGS_PER_SM // (regs * 32 * warps)
    per_byte = sum(loop.values()) * warps / (block_n * block_k * bits / 8)
    return (
        f"w4a16{'-1' if one_row else '  '} bits={bits} group={group} bn={block_n:<3d} bk={block_k:<5d} w={warps}  "
        f"regs {regs:3d}  spill {spill:4d} B  programs/SM {per_sm}  warps/SM {per_sm * warps:2d}\n"
        f"        K loop: {sum(loop.values())} instructions per thread per tile, "
        f"{per_byte:.3f} warp instructions per weight byte (issue limit at full bandwidth "
        f"{ISSUE_PER_BYTE:.3f}): " + ", ".join(f"{op} {n}" for op, n in loop.most_common(10))
    )


MMA_FLOPS_PER_SM_CYCLE = 4096  # Hopper dense bf16: 989 TFLOP/s / (132 SMs x 1.83 GHz)


def report_w4a16_gemm(cfg: tuple[int, ...], arch: int, swap: bool = False, group: int = 128) -> str:
    """The W4A16 GEMM (``kernels/w4a16.py``, bf16 activations, 4-bit weights) per K tile: one
    thread's instructions in the K loop, and the cycles a multiprocessor needs to issue every
    warp's against the cycles its tensor cores need for the tile's MMA (issue-bound if more)."""
    block_m, block_n, block_k, warps, stages = cfg
    from fulcrum.kernels import w4a16 as w4a16_mod

    pointers = dict(x_ptr="*bf16", qw_ptr="*i32", z_ptr="*u8", s_ptr="*bf16", m_ptr="*bf16")
    pointers |= dict(b_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
    const = dict(GROUP=group, BITS=4, HAS_MIN=False, HAS_BIAS=False, IEEE=False, SPLIT=1)
    const |= dict(SWAP=swap, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    k = _compile(w4a16_mod._gemm_kernel, pointers, const, arch, warps, stages, None)
    regs, spill, sass = _ptxas(k.asm["ptx"], arch)
    loop = main_loop(sass)
    per_tile = sum(loop.values()) * warps
    issue = per_tile / 4  # four schedulers per multiprocessor
    mma = 2 * block_m * block_n * block_k / MMA_FLOPS_PER_SM_CYCLE
    per_sm = min(REGS_PER_SM // (regs * 32 * warps), SMEM_PER_SM // max(k.metadata.shared, 1))
    smem_ops = sum(n for op, n in loop.items() if op in ("STS", "LDS", "LDSM", "BAR", "STSM"))
    return (
        f"w4a16-gemm bm={block_m} bn={block_n} bk={block_k} w={warps} st={stages} swap={int(swap)}  "
        f"regs {regs:3d}  spill {spill:4d} B  smem {k.metadata.shared / 1024:5.1f} KB  "
        f"programs/SM {per_sm}\n"
        f"        K loop: {sum(loop.values())} instructions per thread per tile "
        f"({smem_ops} shared-memory ops and barriers); issue {issue:.0f} cycles a tile against "
        f"{mma:.0f} of MMA ({issue / mma:.1f}x): "
        + ", ".join(f"{op} {n}" for op, n in loop.most_common(12))
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--kernel", choices=["decode", "prefill", "gemv", "w4a16", "w4a16-gemm"],
        default="decode",
        help="decode / prefill attention, the batch-1 GEMV, the W4A16 GEMV or the W4A16 GEMM "
        "(group 128)",
    )
    p.add_argument(
        "--weight",
        choices=["bf16", "fp8", "fp8-words", "fp32"],
        default="bf16",
        help="GEMV weight (fp8-words: one row of e4m3 read as int32 words)",
    )
    p.add_argument(
        "--silu", action="store_true", help="GEMV: SiLU-and-mul in its epilogue (silu_gemv)"
    )
    p.add_argument(
        "--rope", action="store_true", help="GEMV: rotary + K/V write in its epilogue (rope_gemv)"
    )
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="KV-cache dtype")
    p.add_argument(
        "--pre-wait",
        action="store_true",
        help="decode: the small-batch variant (<= attention.pre_wait_max_reqs requests, split) "
        "that reads its inputs and first tile before the PDL wait",
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    p.add_argument(
        "--configs",
        nargs="+",
        default=["64,2,3"],
        help="launch configs, each block_n,num_warps,num_stages[,maxnreg] "
        "(gemv, w4a16: block_n,block_k,num_warps; w4a16-gemm: "
        "block_m,block_n,block_k,num_warps,num_stages)",
    )
    args = p.parse_args()
    for c in args.configs:
        cfg = tuple(int(x) for x in c.split(","))
        if args.kernel == "gemv":
            print(report_gemv(args.weight, cfg, args.arch, args.silu, args.rope))
        elif args.kernel == "w4a16-gemm":
            print(report_w4a16_gemm(cfg, args.arch))
            print(report_w4a16_gemm(cfg, args.arch, swap=True))
        elif args.kernel == "w4a16":
            print(report_w4a16(cfg, args.arch, one_row=True))
            print(report_w4a16(cfg, args.arch, one_row=False))
        else:
            print(report(args.kernel, args.kv, cfg, args.arch, args.pre_wait))


if __name__ == "__main__":
    main()
