"""Weight-only integer GEMM: ``y = x @ dequant(W) (+ b)`` for batches of rows, with W packed as
``w4a16_common.py`` lays it out (4- or 8-bit values, a scale and zero per group), and the
layers' entry :func:`linear`, which picks the kernel by row count:

- one or two rows: ``w4a16_gemv.gemv`` (products summed in fp32, no tensor cores);
- more: :func:`gemm`, tiles of x and of the weight dequantized in registers right after its
  load into ``tl.dot`` (tensor cores), so memory streams only the packed words;
- from ``dense_rows`` rows: :func:`dense_linear`, the whole weight dequantized once into a
  shared buffer, then cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.pdl import sm_count
from fulcrum.kernels.w4a16_common import (
    auto_split,
    check,
    check_operands,
    dequant_tile,
    fit_block_k,
    split_counters,
    split_fixup,
    store_tile,
)
from fulcrum.kernels.w4a16_gemv import gemv

# (block_m, block_n, block_k, num_warps) on CUDA, by rows: the best of w4a16_bench.py's sweep
# over the 8B's four linears on an H100 (BENCHMARKS §9.2): 64-row tiles up to 128 rows, then
# 128-row tiles, which dequantize each weight tile for twice the rows.
GEMM_CONFIG = (64, 128, 64, 4)
GEMM_CONFIG_LARGE = (128, 128, 64, 4)
GEMM_LARGE_ROWS = 128
GEMM_MAX_SPLIT = 8
DEQUANT_CONFIG = (64, 128, 4)  # dequantize_dense's (block_k, block_n, num_warps)
GEMV_ROWS = 2  # most rows the GEMV takes in ``linear``; the GEMM above (BENCHMARKS §9.2)
INTERPRET_GEMM_CONFIG = (16, 16, 16, 1)


@triton.jit
def _gemm_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 K_SPLIT, stride_xm, stride_q, stride_z, stride_s, stride_om, GROUP: tl.constexpr,
                 BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 IEEE: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """A [BLOCK_M, BLOCK_N] output tile. ``SWAP``: the tile of out^T = W^T x^T, so the weight
    dequantized in registers is the MMA's first operand (Hopper's wgmma reads only its second
    from shared memory; unswapped, each weight tile is stored there before the MMA)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(2) * K_SPLIT  # split-K: this program's K_SPLIT rows
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        if SWAP:  # x^T's tile [BLOCK_K, BLOCK_M]
            x = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + k[:, None],
                        mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # fmt: skip
        else:
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        w = dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K,
                          stride_q, stride_z, stride_s, GROUP, BITS, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
        if not IEEE:
            w = w.to(x.dtype)
        if SWAP:
            acc = tl.dot(tl.trans(w), x, acc, input_precision="ieee" if IEEE else None)
        else:  # fp32 activations (IEEE): no TF32 rounding
            acc = tl.dot(x, w, acc, input_precision="ieee" if IEEE else None)
    if SWAP:
        acc = tl.trans(acc)
    if SPLIT == 1:
        store_tile(acc, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS,
                   BLOCK_M, False)  # fmt: skip
    else:
        split_fixup(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
                    stride_om, pid_m * tl.num_programs(1) + pid_n, tl.program_id(2), HAS_BIAS,
                    SPLIT, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _dequant_kernel(qw_ptr, z_ptr, s_ptr, m_ptr, out_ptr, N, K, stride_q, stride_z, stride_s,
                    stride_o, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = k0 + tl.arange(0, BLOCK_K)
    mask_k, mask_n = k < K, offs_n < N
    w = dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K, stride_q,
                      stride_z, stride_s, GROUP, BITS, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
    tl.store(out_ptr + k[:, None].to(tl.int64) * stride_o + offs_n[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])  # fmt: skip


def gemm_config(m: int) -> tuple[int, ...]:
    return GEMM_CONFIG if m <= GEMM_LARGE_ROWS else GEMM_CONFIG_LARGE


def gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int = 4,
    config: tuple[int, ...] | None = None,  # (block_m, block_n, block_k, warps[, stages[, split_k]])
    mins: torch.Tensor | None = None,
    swap_ab: bool = False,
) -> torch.Tensor:
    """``x @ dequant(W) (+ bias)`` for a batch of rows, in ``x``'s dtype (``swap_ab``: the
    weight as the MMA's first operand). The launch depends on
    the rows (:func:`gemm_config`); where its tiles leave SMs idle (a narrow layer at a few
    dozen rows: 32 tiles at N = 4,096), K is split as in :func:`gemv`, at most
    ``GEMM_MAX_SPLIT`` ways (the last program of a tile reads every split's partials)."""
    x, out = check_operands(x, qweight, zeros, scales, mins, group, bits)
    m, n, k = x.shape[0], out.shape[1], x.shape[1]
    if m == 0:
        return out
    if config is None:
        config = gemm_config(m) if x.is_cuda else INTERPRET_GEMM_CONFIG
    bm, bn, bk, warps = config[:4]
    stages = {"num_stages": config[4]} if len(config) > 4 and config[4] else {}  # 0: default
    bk = max(16, fit_block_k(bk, k, group))
    grid_m, grid_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    if len(config) > 5:
        split = config[5]
    elif x.is_cuda:
        split = auto_split(k, grid_m * grid_n, bk, sm_count(x.device.index), 1, 4, GEMM_MAX_SPLIT)
    else:
        split = 1
    if split < 1 or k % (split * bk):
        raise ValueError(f"w4a16: split_k {split} x block_k {bk} does not divide K = {k}")
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    counters = out if split == 1 else split_counters(x.device, grid_m * grid_n)
    _gemm_kernel[(grid_m, grid_n, split)](
        x, qweight, zeros, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, out, ws, counters, m, n, k, k // split,
        x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BITS=bits, HAS_MIN=mins is not None, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, SPLIT=split, SWAP=swap_ab, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, **stages,
    )  # fmt: skip
    return out


_SCRATCH: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def dense_scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The buffer :func:`dense_linear` dequantizes each weight into, one per device and dtype:
    layers run one after another on one stream, so they share it. The KV cache's profiling
    forward (every layer at the step's full token count) grows it to the largest layer before
    any CUDA graph is captured, so the budget counts it once and the graphs keep no copy of
    their own (a graph's private pool would hold one per captured bucket). A larger buffer
    joins the older ones rather than replacing them: graphs captured earlier keep their
    addresses."""
    bufs = _SCRATCH.setdefault((device, dtype), [])
    if not bufs or bufs[-1].numel() < numel:
        bufs.append(torch.empty(numel, dtype=dtype, device=device))
    return bufs[-1][:numel]


def dequantize_dense(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    dtype: torch.dtype,
    mins: torch.Tensor | None = None,
    config: tuple[int, int, int] = DEQUANT_CONFIG,  # (block_k, block_n, num_warps)
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[K, N]`` in ``dtype``, dequantized as the kernels do (for a dense GEMM),
    into ``out`` where given."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if out is None:
        out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    bk, bn, warps = config
    bk = max(32 // bits, fit_block_k(bk, k, group))
    _dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        qweight, zeros, scales, mins if mins is not None else scales, out, n, k,
        qweight.stride(0), zeros.stride(0), scales.stride(0), out.stride(0), GROUP=group,
        BITS=bits, HAS_MIN=mins is not None, BLOCK_K=bk, BLOCK_N=bn, num_warps=warps,
    )  # fmt: skip
    return out


def dense_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize the whole weight, then the dense GEMM (cuBLAS on CUDA): at many rows the
    GEMM is compute-bound and the dense one runs at the tensor cores' pace, which repays
    writing and re-reading the weight in ``x``'s dtype once per call."""
    check(x, qweight, zeros, scales, mins, group, bits)
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    w = dense_scratch(k * n, x.dtype, x.device).view(k, n)
    w = dequantize_dense(qweight, zeros, scales, group, bits, x.dtype, mins, out=w)
    return torch.mm(x, w) if bias is None else torch.addmm(bias.to(x.dtype), x, w)


def linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
    *,
    few: bool,
    one_row: bool = True,
    swap_ab: bool = False,
    dense_rows: int = 0,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
) -> torch.Tensor:
    """The layers' entry: :func:`gemv` for one or two of the few rows the layer names ``few``
    (one row through the one-row kernel unless ``one_row`` is off:
    ``kernel_config.gemv.int_one_row``), else :func:`gemm`. From three rows on, the GEMM with
    split-K beats the rows GEMV on every 8B linear (H100: gate_up 80 against 153 us at four
    rows; at two, 80 against 72). From ``dense_rows`` rows (0: never), :func:`dense_linear`;
    ``swap_ab``: the GEMM with swapped operands (``kernel_config.int_gemm``)."""
    if few and x.shape[0] <= GEMV_ROWS:
        return gemv(x, qweight, zeros, scales, bias, group, bits, mins=mins,
                    one_row=None if one_row else False, pdl_cfg=pdl_cfg)  # fmt: skip
    if 0 < dense_rows <= x.shape[0]:
        return dense_linear(x, qweight, zeros, scales, bias, group, bits, mins)
    return gemm(x, qweight, zeros, scales, bias, group, bits, mins=mins, swap_ab=swap_ab)
