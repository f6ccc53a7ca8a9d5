"""The Triton kernels added for mixture-of-experts and INT4 weights build for sm_90 (H100/H200)
with the launch sizes the engine picks on CUDA, at real model shapes, and fit a block's shared
memory: compiled to the cubin by Triton's own ptxas, nothing launched (tests/hopper.py)."""

from __future__ import annotations

from hopper import run_in_subprocess

_MOE = """
import torch
from hopper import check_fits, compile_for_hopper
from fulcrum.kernels.fused_moe import default_launch, fused_moe
from fulcrum.kernels.moe_routing import topk_softmax

with compile_for_hopper() as built:
    # Mixtral-8x7B (8 experts, top 2) and Qwen3-30B-A3B (128 experts, top 8); decode to prefill
    for e, k, h, inter in ((8, 2, 4096, 14336), (128, 8, 2048, 768)):
        for t in (1, 64, 1024):
            for fp8 in (False, True):
                wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
                x = torch.empty(t, h, dtype=torch.bfloat16)
                weights, _ = topk_softmax(torch.empty(t, e, dtype=torch.bfloat16), k, True)
                ids = torch.randint(0, e, (t, k), dtype=torch.int32)
                w13 = torch.empty(e, 2 * inter, h, dtype=wdt)
                w2 = torch.empty(e, h, inter, dtype=wdt)
                s13 = torch.empty(e, 2 * inter) if fp8 else None
                s2 = torch.empty(e, h) if fp8 else None
                fused_moe(x, w13, w2, weights, ids, s13, s2, default_launch(t * k, e, True))
check_fits(built)
print(sorted({(c.name, c.shared) for c in built}))
"""

_W4A16 = """
import torch
from hopper import check_fits, compile_for_hopper
from fulcrum.kernels import w4a16, w4a16_gemv

with compile_for_hopper() as built:
    # Llama-3.1-8B's projections (K, N): qkv, o, gate_up, down
    for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
        for bits, group, mins in ((4, 128, False), (8, 128, False), (4, 32, True)):
            g = k // group
            qweight = torch.empty(k * bits // 32, n, dtype=torch.int32)
            zeros = torch.empty(g, n, dtype=torch.uint8)
            scales = torch.empty(g, n, dtype=torch.bfloat16)
            m_ = torch.empty(g, n, dtype=torch.bfloat16) if mins else None
            for m, cfg in ((1, w4a16_gemv.GEMV1_CONFIG), (4, w4a16_gemv.GEMV_CONFIG)):
                x = torch.empty(m, k, dtype=torch.bfloat16)
                w4a16_gemv.gemv(x, qweight, zeros, scales, None, group, bits, cfg, m_)
                w4a16_gemv.gemv(x, qweight, zeros, scales, None, group, bits, cfg + (4,), m_)
            for m, cfg in ((64, w4a16.GEMM_CONFIG + (0, 4)), (512, w4a16.GEMM_CONFIG_LARGE)):
                x = torch.empty(m, k, dtype=torch.bfloat16)
                w4a16.gemm(x, qweight, zeros, scales, None, group, bits, cfg, m_)
                w4a16.gemm(x, qweight, zeros, scales, None, group, bits, cfg, m_, swap_ab=True)
            w4a16.dequantize_dense(qweight, zeros, scales, group, bits, torch.bfloat16, m_)
check_fits(built)
print(sorted({(c.name, c.shared) for c in built}))
"""

_FUSED = """
import torch
from hopper import check_fits, compile_for_hopper
from fulcrum.config import AttentionKernelConfig
from fulcrum.kernels import w4a16_gemv
from fulcrum.kernels.decode_attention import decode_attention
from fulcrum.kernels.rotary import apply_rotary

with compile_for_hopper() as built:
    # the one-row INT4 kernel's epilogues at Llama-3.1-8B's gate_up and qkv, split-K as on CUDA
    for k, n in ((4096, 28672), (4096, 6144)):
        qweight = torch.empty(k // 8, n, dtype=torch.int32)
        zeros = torch.empty(k // 128, n, dtype=torch.uint8)
        scales = torch.empty(k // 128, n, dtype=torch.bfloat16)
        x = torch.empty(1, k, dtype=torch.bfloat16)
        for split in (1, 4):
            cfg = w4a16_gemv.GEMV1_CONFIG + (split,)
            if n == 28672:
                w4a16_gemv.silu_gemv1(x, qweight, zeros, scales, None, 128, config=cfg)
                continue
            for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                cache = torch.empty(2, 64, 16, 8, 128, dtype=cache_dtype)
                w4a16_gemv.rope_gemv1(
                    x, qweight, zeros, scales, None, 128, 4, None, torch.zeros(1, dtype=torch.long),
                    torch.empty(4096, 128), cache, torch.zeros(1, dtype=torch.long), 32, 8,
                    config=cfg,
                )
    # Qwen3's q/k norms in the rotary kernel; decode attention's splits combined in-kernel
    q, k, v = torch.empty(4, 40, 128, dtype=torch.bfloat16).split([32, 4, 4], dim=1)
    cache = torch.empty(2, 64, 16, 4, 128, dtype=torch.bfloat16)
    w = torch.empty(128, dtype=torch.bfloat16)
    slots = torch.zeros(4, dtype=torch.long)
    apply_rotary(q, k, slots, torch.empty(4096, 128), (v, cache, slots), qk_norm=(w, w, 1e-6))
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.empty(2, 64, 16, 8, 128, dtype=cache_dtype)
        decode_attention(torch.empty(1, 32, 128, dtype=torch.bfloat16), cache,
                         torch.zeros(1, 64, dtype=torch.int32), torch.full((1,), 900, dtype=torch.int32),
                         0.1, num_splits=16, cfg=AttentionKernelConfig(combine_max_reqs=4))
check_fits(built)
print(sorted({c.name for c in built}))
"""


def test_fused_epilogues_build_for_hopper() -> None:
    """The INT4 one-row kernel's SiLU and rotary epilogues, the rotary kernel with q/k norms and
    the decode split kernel with the in-kernel combine build for sm_90."""
    out = run_in_subprocess(_FUSED)
    assert "_gemv1_kernel" in out and "_rotary_kernel" in out and "_decode_split_kernel" in out
    assert "_decode_reduce_kernel" not in out  # combined in the splits


def test_fused_moe_kernels_build_for_hopper() -> None:
    out = run_in_subprocess(_MOE)
    assert "_moe_gemm_kernel" in out and "_align_kernel" in out


def test_w4a16_kernels_build_for_hopper() -> None:
    out = run_in_subprocess(_W4A16)
    assert "_gemv_kernel" in out and "_gemv1_kernel" in out and "_gemm_kernel" in out
    assert "_dequant_kernel" in out


_GEMV_WORDS = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import kernel_resources as kr
from fulcrum.kernels import gemv

block_n, block_k, warps = gemv.GPU_CONFIG["fp8_words"]
ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16")
const = dict(K=4096, HAS_SCALE=True, HAS_BIAS=False, BLOCK_M=1, PDL=0, SILU=False, ROPE=False,
             BLOCK_N=block_n, BLOCK_K=block_k, WORDS=True, FAST=True, **gemv._NO_ROPE)
k = kr._compile(gemv._gemv_kernel, ptrs, const, 90, warps, 1, None)
_, spill, sass = kr._ptxas(k.asm["ptx"], 90)
loop = kr.main_loop(sass)
print("cvt", k.asm["ptx"].count("cvt.rn.f16x2.e4m3x2"), "spill", spill)
print("weights", block_n * block_k // (32 * warps), "loop", dict(loop))

from fulcrum.kernels import w4a16_gemv
block_n, block_k, warps = w4a16_gemv.GEMV1_CONFIG
ptrs = dict(x_ptr="*bf16", qw_ptr="*i32", z_ptr="*u8", s_ptr="*bf16", m_ptr="*bf16",
            b_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
const = dict(GROUP=128, BITS=4, HAS_MIN=False, HAS_BIAS=False, SPLIT=2, BLOCK_N=block_n,
             BLOCK_K=block_k, PDL=0, FAST=True, **w4a16_gemv.PLAIN_EPILOGUE)
k = kr._compile(w4a16_gemv._gemv1_kernel, ptrs, const, 90, warps, 1, None)
_, spill, sass = kr._ptxas(k.asm["ptx"], 90)
loop = kr.main_loop(sass)
print("int4 spill", spill, "weights", block_n * block_k // (32 * warps), "loop", dict(loop))
"""


def test_one_row_fp8_and_int4_gemvs_build_for_hopper_as_designed() -> None:
    """The one-row FP8 GEMV's word path, compiled to SASS for sm_90: one conversion per pair
    of weights, one FMA per weight, and no shared-memory round trip in the K loop (x's columns
    of a word are already in the thread that holds the word). The one-row INT4 GEMV's inline
    PTX (``_nibbles``): one conversion per weight, half a logic instruction, no spills."""
    import ast
    import os

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    out = run_in_subprocess(_GEMV_WORDS.replace("os.getcwd()", repr(os.path.abspath(root))))
    lines = out.splitlines()
    assert lines[0].split()[1] != "0" and "spill 0" in lines[0], out  # the inline asm is in
    weights = int(lines[1].split()[1])
    loop = ast.literal_eval(lines[1].split("loop ", 1)[1])
    assert loop["F2FP"] == weights // 2 and loop["FFMA"] == weights, loop
    assert not {"BAR", "LDS", "STS", "STSM", "LDSM"} & set(loop), loop
    words = lines[2].split()
    assert words[:3] == ["int4", "spill", "0"], out
    weights, loop = int(words[4]), ast.literal_eval(lines[2].split("loop ", 1)[1])
    assert loop["HADD2"] == weights and loop["LOP3"] <= weights // 2 + 8, loop
