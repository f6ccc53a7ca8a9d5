"""The K-quant kernels compile for an H100/H200 (sm_90) with their CUDA launch configs, without a
GPU: Triton's compiler and its bundled ptxas run on the CPU (in a subprocess, since this
session's kernels are defined for the interpreter): the GPU-only code paths (tensor-core dots,
fp32 atomics, layouts of the 3-D reshapes) at least build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fulcrum.kernels import kquant

    BASE = dict(x_ptr="*bf16", lo_ptr="*i32", hi_ptr="*i32", m_ptr="*u8", d_ptr="*fp16",
                dm_ptr="*fp16", b_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32",
                stride_xm="i32", stride_om="i32")
    for qtype, (hi, sub, zero, has_min) in kquant.TYPES.items():
        sig = dict(BASE, sc_ptr="*i8" if qtype == "Q6_K" else "*u8")
        bn, bk, warps = kquant.GEMV_CONFIG
        for split, bm in ((1, 1), (4, 4)):
            c = dict(HI=hi, SUB=sub, ZERO=zero, HAS_MIN=has_min, HAS_BIAS=True, SPLIT=split,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            s = dict(sig, K_SPLIT="i32", out_ptr="*bf16" if split == 1 else "*fp32")
            s.update({k: "constexpr" for k in c})
            k = triton.compile(ASTSource(kquant._gemv_kernel, s, constexprs=c),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            print("gemv", qtype, split, bm, len(k.asm["cubin"]))
        bm, bn, bk, warps = kquant.GEMM_CONFIG
        c = dict(HI=hi, SUB=sub, ZERO=zero, HAS_MIN=has_min, HAS_BIAS=False, IEEE=False,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        s = dict(sig)
        s.update({k: "constexpr" for k in c})
        k = triton.compile(ASTSource(kquant._gemm_kernel, s, constexprs=c),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        print("gemm", qtype, len(k.asm["cubin"]))
    """
)


def test_kernels_compile_for_sm90(tmp_path) -> None:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.path.abspath(src))  # fmt: skip
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    if out.returncode and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert sum(line.startswith("gemv") for line in lines) == 6
    assert sum(line.startswith("gemm") for line in lines) == 3
