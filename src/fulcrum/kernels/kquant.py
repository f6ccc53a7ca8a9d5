"""GGUF K-quant GEMV and GEMM: ``y = x @ dequant(W) (+ b)`` over Q4_K, Q5_K or Q6_K weights.

llama.cpp's K-quants split each run of 256 input rows (a super-block) into sub-blocks with a
small integer scale each, which an fp16 scale per super-block multiplies::

    Q4_K  4-bit q, 8 sub-blocks of 32, 6-bit sc and m:  w = d * sc * q - dmin * m
    Q5_K  5-bit q, the same scales
    Q6_K  6-bit q, 16 sub-blocks of 16, int8 sc:        w = d * sc * (q - 32)

``quant/gguf_kquant.py`` repacks a tensor's blocks once at load into this layout (output
features along columns, as ``w4a16_common.py`` lays out its words; K a multiple of 256)::

    qlo       int32 [K / 8, N]        low 4 bits of q, row k at bits (k % 8) * 4 of word k // 8
    qhi       int32 [K * H / 32, N]   the H high bits (H = 1 for Q5_K, 2 for Q6_K; none for
                                      Q4_K), row k at bits (k % P) * H of word k // P, P = 32 / H
    sc        uint8 [K / SUB, N]      SUB = 32 (Q4_K, Q5_K); int8 and SUB = 16 for Q6_K
    m         uint8 [K / 32, N]       Q4_K, Q5_K
    d, dmin   fp16 [K / 256, N]       dmin: Q4_K, Q5_K
    w[k, n] = (q - ZERO) * (d * sc) - dmin * m     (fp32; ZERO = 32 for Q6_K, else 0)

These are the products of ``gguf``'s own dequantizer, in its order, so the torch path's weight
equals it exactly. Memory holds 4.625, 5.625 and 6.5625 bits a weight (the file: 4.5, 5.5,
6.5625; its 6-bit scales are widened to bytes), and the kernels dequantize in registers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fulcrum.kernels.w4a16_common import gemv_step, int_minus, store_tile, unpack_rows

SUPER = 256
# type -> (H high bits, SUB rows per sub-scale, ZERO, has mins)
TYPES = {"Q4_K": (0, 32, 0, True), "Q5_K": (1, 32, 0, True), "Q6_K": (2, 16, 32, False)}
GEMV_CONFIG = (32, 128, 4)  # (block_n, block_k, num_warps) on CUDA: ~100 registers, no spills
GEMM_CONFIG = (64, 128, 64, 4)  # (block_m, block_n, block_k, num_warps) on CUDA; not tuned
# (benchmarks/kquant_bench.py sweeps both)
INTERPRET_GEMV_CONFIG = (16, 64, 1)
INTERPRET_GEMM_CONFIG = (16, 16, 32, 1)


class KPacked(NamedTuple):
    """One weight in the layout above; ``qhi``, ``m`` and ``dmin`` are None where the type has none."""

    qtype: str
    qlo: torch.Tensor
    qhi: torch.Tensor | None
    sc: torch.Tensor
    m: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None


def dequantize(w: KPacked) -> torch.Tensor:
    """The weight ``[K, N]`` in fp32, computed as the kernels compute it (the torch path)."""
    hi, sub, zero, has_min = TYPES[w.qtype]
    q = unpack_rows(w.qlo, 4)
    if hi:
        q |= unpack_rows(w.qhi, hi) << 4
    k, n = q.shape
    s = w.d.float().repeat_interleave(SUPER // sub, 0) * w.sc.float()  # [K / SUB, N]
    out = (q - zero).float().view(k // sub, sub, n) * s[:, None, :]
    if has_min:
        out -= (w.dmin.float().repeat_interleave(SUPER // 32, 0) * w.m.float())[:, None, :]
    return out.view(k, n)


def random_packed(qtype: str, n: int, k: int, generator: torch.Generator, device) -> KPacked:
    """Random words and scales in the layout (benchmarks, GPU tests): weights of about +-0.02."""
    hi, sub, _, has_min = TYPES[qtype]
    kw = {"generator": generator, "device": device}

    def words(rows: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, (rows, n), dtype=torch.int32, **kw)

    def small(rows: int, lo: int, hi_: int, dtype) -> torch.Tensor:
        return torch.randint(lo, hi_, (rows, n), **kw).to(dtype)

    qmax = (1 << (4 + hi)) - 1
    d = (torch.rand(k // SUPER, n, **kw) * 0.02 / (63 * qmax) + 1e-7).half()
    if not has_min:
        sc = small(k // sub, -128, 128, torch.int8)
        return KPacked(qtype, words(k // 8), words(k * hi // 32), sc, None, d * 4, None)
    m, dmin = small(k // 32, 0, 64, torch.uint8), (d.float() * qmax / 2).half()
    qhi = words(k * hi // 32) if hi else None
    return KPacked(qtype, words(k // 8), qhi, small(k // sub, 0, 64, torch.uint8), m, d, dmin)


def reference_matmul(x: torch.Tensor, w: KPacked, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize, then matmul in fp32: what both kernels must equal."""
    y = x.float() @ dequantize(w)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _tile(lo_ptr, hi_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, HI: tl.constexpr,
          SUB: tl.constexpr, ZERO: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows ``k0 .. k0 + BLOCK_K`` (inside one super-block) x columns ``offs_n``, in fp32."""
    n2 = offs_n[None, :]
    m2 = mask_n[None, :]
    # Each word loaded once and spread over its rows: [BLOCK_K / P, N] -> [BLOCK_K / P, P, N].
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    lo = tl.load(lo_ptr + rows[:, None] * N + n2, mask=m2, other=0)
    q = tl.reshape(
        (lo[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF, [BLOCK_K, BLOCK_N]
    )
    if HI > 0:
        P: tl.constexpr = 32 // HI
        hrows = k0 // P + tl.arange(0, BLOCK_K // P)
        hw = tl.load(hi_ptr + hrows[:, None] * N + n2, mask=m2, other=0)
        hq = (hw[:, None, :] >> (tl.arange(0, P) * HI)[None, :, None]) & ((1 << HI) - 1)
        q |= tl.reshape(hq, [BLOCK_K, BLOCK_N]) << 4
    sb = k0 // 256
    d = tl.load(d_ptr + sb * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    g = k0 // SUB + tl.arange(0, BLOCK_K // SUB)
    s = d[None, :] * tl.load(sc_ptr + g[:, None] * N + n2, mask=m2, other=0).to(tl.float32)
    w = tl.reshape(int_minus(q, ZERO), [BLOCK_K // SUB, SUB, BLOCK_N]) * s[:, None, :]
    if HAS_MIN:  # SUB is 32, the mins' sub-block
        dmin = tl.load(dm_ptr + sb * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + g[:, None] * N + n2, mask=m2, other=0).to(tl.float32)
        w -= (dmin[None, :] * mn)[:, None, :]
    return tl.reshape(w, [BLOCK_K, BLOCK_N])


@triton.jit
def _gemv_kernel(x_ptr, lo_ptr, hi_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, M, N, K,
                 stride_xm, stride_om, K_SPLIT, HI: tl.constexpr, SUB: tl.constexpr,
                 ZERO: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # One row: products summed elementwise, one reduction at the end (as kernels/gemv.py).
    acc1 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(1) * K_SPLIT  # split-K: this program's K_SPLIT rows
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _tile(lo_ptr, hi_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, HI, SUB,
                  ZERO, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
        acc1, acc = gemv_step(acc1, acc, w, x_ptr, k, k < K, offs_m, mask_m, stride_xm, BLOCK_M)
    if SPLIT == 1:
        store_tile(acc1, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                   HAS_BIAS, BLOCK_M, True)  # fmt: skip
    else:  # partial sums added into an fp32 output (the first split adds the bias)
        if BLOCK_M == 1:
            acc = tl.sum(acc1, axis=0)[None, :]
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=mask_n & (k_start == 0), other=0.0)
            acc += b.to(tl.float32)[None, :]
        dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.atomic_add(dst, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gemm_kernel(x_ptr, lo_ptr, hi_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, M, N, K,
                 stride_xm, stride_om, HI: tl.constexpr, SUB: tl.constexpr, ZERO: tl.constexpr,
                 HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=mask_m[:, None], other=0.0)  # fmt: skip
        w = _tile(lo_ptr, hi_ptr, sc_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, HI, SUB,
                  ZERO, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
        if IEEE:  # fp32 activations: no TF32 rounding
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    store_tile(acc, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS,
               BLOCK_M, False)  # fmt: skip


def _prepare(x: torch.Tensor, w: KPacked, block_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``x`` with unit stride along K, checked against ``w``; the output; the K tile (a power of
    two from 32 to 256: inside one super-block, whole words and sub-blocks)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.qlo.shape[1]
    if w.qtype not in TYPES or k % SUPER or w.qlo.shape[0] * 8 != k:
        raise ValueError(f"kquant: x {tuple(x.shape)}, {w.qtype} weight {tuple(w.qlo.shape)} "
                         f"words do not fit (K a multiple of {SUPER})")  # fmt: skip
    for t in w[1:]:
        assert t is None or (t.is_contiguous() and t.shape[-1] == n), "kquant: bad layout"
    block_k = min(max(32, triton.next_power_of_2(block_k)), SUPER)
    return x, torch.empty((m, n), dtype=x.dtype, device=x.device), block_k


def _launch(kernel, grid, x, w: KPacked, bias, out, **meta) -> torch.Tensor:
    hi, sub, zero, has_min = TYPES[w.qtype]
    opt = w.qlo  # any tensor stands in for a pointer the type does not read
    m, k = x.shape
    kernel[grid](
        x, w.qlo, w.qhi if hi else opt, w.sc, w.m if has_min else opt, w.d,
        w.dmin if has_min else opt, bias if bias is not None else opt, out, m, out.shape[1], k,
        x.stride(0), out.stride(0), HI=hi, SUB=sub, ZERO=zero, HAS_MIN=has_min,
        HAS_BIAS=bias is not None, **meta,
    )  # fmt: skip
    return out


def gemv(
    x: torch.Tensor,  # [M, K], a few rows
    w: KPacked,
    bias: torch.Tensor | None,
    config: tuple[int, ...] | None = None,  # (block_n, block_k, num_warps[, split_k])
) -> torch.Tensor:
    """``x @ dequant(w) (+ bias)`` for a few rows of ``x``, in ``x``'s dtype. ``split_k`` > 1
    (benchmarks) splits K over that many programs per strip, summed with fp32 atomics: more
    programs where N is narrow, at the cost of run-to-run bitwise equality."""
    cfg = config or (GEMV_CONFIG if x.is_cuda else INTERPRET_GEMV_CONFIG)
    block_n, block_k, warps = cfg[:3]
    x, out, block_k = _prepare(x, w, block_k)
    m, k = x.shape
    split = cfg[3] if len(cfg) > 3 else 1
    if m == 0:
        return out
    if split < 1 or k % (split * block_k):
        raise ValueError(f"kquant: split_k {split} x block_k {block_k} does not divide K = {k}")
    grid = (triton.cdiv(out.shape[1], block_n), split)
    dst = out if split == 1 else torch.zeros(out.shape, dtype=torch.float32, device=x.device)
    _launch(_gemv_kernel, grid, x, w, bias, dst, K_SPLIT=k // split, SPLIT=split,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)  # fmt: skip
    return out if split == 1 else dst.to(x.dtype)


def gemm(
    x: torch.Tensor,  # [M, K]
    w: KPacked,
    bias: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,  # (block_m, block_n, block_k, num_warps)
) -> torch.Tensor:
    """``x @ dequant(w) (+ bias)`` for a batch of rows, in ``x``'s dtype."""
    bm, bn, bk, warps = config or (GEMM_CONFIG if x.is_cuda else INTERPRET_GEMM_CONFIG)
    x, out, bk = _prepare(x, w, bk)
    if x.shape[0] == 0:
        return out
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(out.shape[1], bn))
    return _launch(_gemm_kernel, grid, x, w, bias, out, IEEE=x.dtype == torch.float32,
                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)  # fmt: skip
