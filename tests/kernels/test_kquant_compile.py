"""The GGUF K-quant kernels build for sm_90 (H100/H200) with the launch sizes the engine picks
on CUDA (the GEMV with and without split-K), at Llama-3.1-8B shapes, and fit a block's shared
memory: compiled to the cubin by Triton's own ptxas, nothing launched (tests/hopper.py)."""

from __future__ import annotations

from hopper import run_in_subprocess

_KQUANT = """
import torch
from hopper import check_fits, compile_for_hopper
from fulcrum.kernels import kquant

with compile_for_hopper() as built:
    for qtype in kquant.TYPES:
        for k, n in ((4096, 6144), (14336, 4096)):  # qkv, down
            w = kquant.random_packed(qtype, n, k, torch.Generator().manual_seed(0), "cpu")
            for m in (1, 4):
                x = torch.empty(m, k, dtype=torch.bfloat16)
                kquant.gemv(x, w, None, kquant.GEMV_CONFIG)  # CPU tensors: name the CUDA sizes
                kquant.gemv(x, w, torch.empty(n, dtype=torch.bfloat16), (*kquant.GEMV_CONFIG, 4))
            kquant.gemm(torch.empty(512, k, dtype=torch.bfloat16), w, None, kquant.GEMM_CONFIG)
check_fits(built)
print(sorted({(c.name, c.shared) for c in built}))
"""


def test_kquant_kernels_build_for_hopper() -> None:
    out = run_in_subprocess(_KQUANT)
    assert "_gemv_kernel" in out and "_gemm_kernel" in out
