"""Weight-only integer GEMM and GEMV: ``y = x @ dequant(W) (+ b)`` with packed 4- or 8-bit W.

The one layout both kernels read (``quant/int4.py`` repacks GPTQ and AWQ checkpoints into it
once at load)::

    qweight  int32 [K / PACK, N]   PACK = 32 / BITS values of consecutive input rows k per word,
                                   row k at bits (k % PACK) * BITS of word k // PACK
    zeros    uint8 [G, N]          (int16 where a zero is 256) zero point of group g = k // GROUP (G = K / GROUP)
    scales   fp16/bf16/fp32 [G, N]
    mins     optional, as scales   (GGUF Q4_1's additive term; zeros then 0)
    w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] (+ mins[g, n])  (fp32)

The weight is dequantized in registers right after its load, so memory holds and streams only
the packed words (a quarter of bf16's bytes at 4 bits, plus one scale and zero per group).
An act-order (``desc_act``) checkpoint's rows are permuted at load so that groups are
contiguous; the caller permutes x's columns the same way.

- ``gemm``: tiles of x and of the dequantized weight into ``tl.dot`` (tensor cores), for batches.
- ``gemv``: one to a few rows of x, products summed in fp32 without ``tl.dot`` (whose M tile
  would be mostly padding), each program streaming a strip of N columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.pdl import sm_count

# (block_n, block_k, num_warps) on CUDA; not tuned (benchmarks/w4a16_bench.py sweeps them)
GEMV_CONFIG = (32, 256, 4)
# One row of x (batch-1 decode): (block_n, block_k, num_warps); block_k shrinks to fit the group.
# The fastest of w4a16_bench.py's sweep over the 8B's four linears on an H100 (BENCHMARKS §9.2).
GEMV1_CONFIG = (128, 64, 1)
INTERPRET_GEMV1_CONFIG = (16, 16, 1)
_EXPO = 150 << 23  # float bits of 2**23 (``_gemv1_kernel``'s ``expo``)
# (block_m, block_n, block_k, num_warps) on CUDA, by rows: the best of w4a16_bench.py's sweep
# over the 8B's four linears on an H100 (BENCHMARKS §9.2): 64-row tiles up to 128 rows, then
# 128-row tiles, which dequantize each weight tile for twice the rows.
GEMM_CONFIG = (64, 128, 64, 4)
GEMM_CONFIG_LARGE = (128, 128, 64, 4)
GEMM_LARGE_ROWS = 128
GEMM_MAX_SPLIT = 8
DEQUANT_CONFIG = (64, 128, 4)  # dequantize_dense's (block_k, block_n, num_warps)
GEMV_ROWS = 2  # most rows the GEMV takes in ``linear``; the GEMM above (BENCHMARKS §9.2)
INTERPRET_GEMV_CONFIG = (16, 16, 1)
INTERPRET_GEMM_CONFIG = (16, 16, 16, 1)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``int32 [K / PACK, N]`` -> ``int32 [K, N]`` values in ``[0, 2**bits)``."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(-1, qweight.shape[1]) if pack > 1 else q[:, 0]


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rows`: ``[K, N]`` values -> ``int32 [K / PACK, N]``."""
    pack = 32 // bits
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // pack, pack, n)
    out = torch.zeros(k // pack, n, dtype=torch.int32, device=q.device)
    for j in range(pack):
        out |= q[:, j, :] << (j * bits)
    return out


def dequantize(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[K, N]`` in fp32, computed as the kernels compute it (the torch path)."""
    q = unpack_rows(qweight, bits)
    g = torch.arange(q.shape[0], device=q.device) // group
    w = (q - zeros.to(torch.int32)[g]).float() * scales.float()[g]
    return w if mins is None else w + mins.float()[g]


def dequantize_t(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(...).t()`` made contiguous (``[N, K]``, ``F.linear``'s layout), built in
    that layout with broadcasts over whole groups and in-place steps: the CPU path's cost."""
    n = qweight.shape[1]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    words = qweight.t().contiguous()  # an eighth of the weight: makes the result [N, K] row-major
    q = (words[:, :, None] >> shifts).bitwise_and_((1 << bits) - 1)  # [N, K / P, P]
    q = q.view(n, -1, group)  # [N, G, group]
    q.sub_(zeros.t().to(torch.int32)[:, :, None])
    w = q.float().mul_(scales.t().float()[:, :, None])
    if mins is not None:
        w.add_(mins.t().float()[:, :, None])
    return w.view(n, -1)


def reference_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize, then matmul in fp32: what both kernels must equal."""
    y = x.float() @ dequantize(qweight, zeros, scales, group, bits, mins)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def int_minus(q, zf):
    """``q - zf`` in fp32 for int32 ``q`` in ``[0, 2**23)`` and integral ``zf`` (fp32, under
    2**23), without an integer-to-float conversion per weight: that conversion is a slow
    instruction and bounds the GEMV once the packed words stream at full bandwidth. q's bits
    OR'd into the mantissa of 2**23 give the float 2**23 + q exactly, and one subtraction of
    2**23 + zf (exact: both under 2**24) leaves q - zf, bit for bit what the conversion gives."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (zf + 8388608.0)


@triton.jit
def _dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K, stride_q, stride_z,
                  stride_s, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows ``k`` x columns ``offs_n`` of the weight, dequantized to fp32 ``[BLOCK_K, BLOCK_N]``."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = mask_k[:, None] & mask_n[None, :]
    # Each packed word loaded once, then spread over its PACK rows: words [BLOCK_K / PACK, N]
    # -> [BLOCK_K / PACK, PACK, N] -> rows k0 .. k0 + BLOCK_K (row-major: word i, value j).
    rows = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    mask_w = (rows < K // PACK)[:, None] & mask_n[None, :]
    qw = tl.load(qw_ptr + rows[:, None] * stride_q + offs_n[None, :], mask=mask_w, other=0)
    # Values become floats as in ``int_minus``, but masked in place: a value at bit ``pos``
    # under an exponent that makes its unit 1 is the float 2**(23 - pos) + q (values above
    # mantissa bit 22 are shifted down 16 bits first), which saves the shift per value.
    j = tl.arange(0, PACK)
    sh = tl.where(BITS * (j + 1) > 23, 16, 0)
    pos = BITS * j - sh
    expo = (150 - pos) << 23  # float bits of 2**(23 - pos)
    bits = ((qw[:, None, :] >> sh[None, :, None]) & (MASK << pos)[None, :, None]) | expo[None, :, None]
    v = bits.to(tl.float32, bitcast=True)  # [BLOCK_K / PACK, PACK, BLOCK_N]: 2**(23 - pos) + q
    base = expo.to(tl.float32, bitcast=True)[None, :, None]
    if GROUP % BLOCK_K == 0:  # the whole tile in one group: one row of zeros and scales
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_z + offs_n, mask=mask_n, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = tl.reshape((v - (base + z[None, None, :])) * s[None, None, :], [BLOCK_K, BLOCK_N])
        if HAS_MIN:
            mn = tl.load(m_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        g = (k // GROUP)[:, None]
        z = tl.load(z_ptr + g * stride_z + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_s + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        w = (tl.reshape(v - base, [BLOCK_K, BLOCK_N]) - z) * s
        if HAS_MIN:
            mn = tl.load(m_ptr + g * stride_s + offs_n[None, :], mask=mask, other=0.0)
    if HAS_MIN:
        w += mn.to(tl.float32)
    return w


@triton.jit
def gemv_step(acc1, acc, w, x_ptr, k, mask_k, offs_m, mask_m, stride_xm, BLOCK_M: tl.constexpr):
    """Add rows ``k`` of x times the weight tile ``w`` (fp32 ``[BLOCK_K, BLOCK_N]``): one row
    into ``acc1`` elementwise (reduced once at the end by :func:`store_tile`), more into ``acc``."""
    if BLOCK_M == 1:
        acc1 += w * tl.load(x_ptr + k, mask=mask_k, other=0.0).to(tl.float32)[:, None]
    else:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc1, acc


@triton.jit
def store_tile(acc1, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, ROW_SUM: tl.constexpr):  # fmt: skip
    """``acc`` (or, with ``ROW_SUM`` and one row, ``acc1`` summed over K) plus the bias, stored."""
    if ROW_SUM:
        if BLOCK_M == 1:
            acc = tl.sum(acc1, axis=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def split_fixup(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
                stride_om, strip, split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Split-K's sum inside the kernel: this program stores its fp32 partial sums ``acc``
    (``[BLOCK_M, BLOCK_N]``) into ``ws[split]`` (``[SPLIT, M, N]``) and counts itself done on
    its output tile's counter (``strip``); the tile's last program adds the SPLIT partials in
    split order (the same sums whichever program finishes last), adds the bias, stores the
    output and resets the counter for the next launch. A separate sum would cost a launch and a pass over the
    partials per linear, most of a narrow layer's time at batch 1.

    The barrier puts every thread's stores before the count (one thread's release, as
    CUTLASS's semaphore); the last program reads the partials past L1, which may hold lines
    of the same workspace from an earlier launch."""
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(ws_ptr + split * M * N + offs, acc, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + strip, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + strip, 0)


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
        w = _dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K,
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
    w = _dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K, stride_q,
                      stride_z, stride_s, GROUP, BITS, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
    tl.store(out_ptr + k[:, None].to(tl.int64) * stride_o + offs_n[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                 K_SPLIT, stride_xm, stride_q, stride_z, stride_s, stride_om,
                 GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # One row: products summed elementwise, one reduction at the end (as kernels/gemv.py).
    acc1 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(1) * K_SPLIT  # split-K: this program's K_SPLIT rows
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        w = _dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K,
                          stride_q, stride_z, stride_s, GROUP, BITS, HAS_MIN, BLOCK_K, BLOCK_N)  # fmt: skip
        acc1, acc = gemv_step(acc1, acc, w, x_ptr, k, mask_k, offs_m, mask_m, stride_xm, BLOCK_M)
    if SPLIT == 1:
        store_tile(acc1, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_BIAS,
                   BLOCK_M, True)  # fmt: skip
    else:
        if BLOCK_M == 1:
            acc = tl.sum(acc1, axis=0)[None, :]
        split_fixup(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
                    stride_om, tl.program_id(0), tl.program_id(1), HAS_BIAS, SPLIT, BLOCK_M,
                    BLOCK_N)  # fmt: skip


@triton.jit
def _gemv1_tile(acc, lo, x_ptr, z_ptr, s_ptr, m_ptr, k0, offs_n, mask_n, offs_r, stride_z, stride_s,
                expo, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                BLOCK_N: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """``acc`` plus one K tile of :func:`_gemv1_kernel`: ``lo`` holds the tile's packed words."""
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    MASK: tl.constexpr = (1 << BITS) - 1
    hi = (lo.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    part = tl.zeros([BLOCK_N], dtype=tl.float32)
    xsum = tl.zeros([R], dtype=tl.float32)
    for j in tl.static_range(PACK):
        pos = BITS * (j % HALF)
        if j < HALF:
            word = lo
        else:
            word = hi
        e = expo - (pos << 23)  # float bits of 2**(23 - pos)
        q = ((word & (MASK << pos)) | e).to(tl.float32, bitcast=True)
        q = q - e.to(tl.float32, bitcast=True)  # exact: the value as a float
        xj = tl.load(x_ptr + k0 + offs_r * PACK + j).to(tl.float32)
        part += tl.sum(xj[:, None] * q, axis=0)
        xsum += xj
    xs = tl.sum(xsum, axis=0)
    g = k0 // GROUP
    z = tl.load(z_ptr + g * stride_z + offs_n, mask=mask_n, other=0).to(tl.float32)
    sc = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc += sc * (part - z * xs)
    if HAS_MIN:
        acc += tl.load(m_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32) * xs
    return acc


@triton.jit
def _gemv1_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K_SPLIT,
                  stride_q, stride_z, stride_s, expo, GROUP: tl.constexpr, BITS: tl.constexpr,
                  HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One row of x. A tile lies inside one group, so its scale and zero come out of the sum:
    ``sum_k x_k (q_k - z) s + m sum_k x_k = s (sum_k x_k q_k - z sum_k x_k) + m sum_k x_k``,
    leaving about four instructions per weight in the compiled loop (mask, exact float, fused
    multiply-add, a share of x's loads) where dequantize-then-multiply takes about nine
    (``benchmarks/kernel_resources.py --kernel w4a16``): the K loop is bound by instructions
    issued per weight byte, not by memory. Each thread holds all rows of its columns' words, so the
    sum over K stays in registers; the words' values become floats without a conversion
    instruction (see ``int_minus``): masked in place in the low or high half-word, OR'd with
    the exponent that makes their unit 1, minus that power of two. ``expo`` (always
    ``150 << 23``, the bits of 2**23) arrives as an argument so that the exponents stay in
    registers: with both mask and exponent as immediates the compiler spends two logic
    instructions per weight instead of one.

    Launched with PDL (``kernels/pdl.py``), the first tile's words are read before the wait
    (weights are never written during a step), so they stream while the kernel before
    finishes; the first tile is peeled off the loop to keep them in registers."""
    PACK: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PACK
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, R)
    k_start = tl.program_id(1) * K_SPLIT
    w_ptrs = qw_ptr + offs_r[:, None] * stride_q + offs_n[None, :]
    lo = tl.load(w_ptrs + (k_start // PACK) * stride_q, mask=mask_n[None, :], other=0)
    pdl.wait(PDL)
    acc = _gemv1_tile(tl.zeros([BLOCK_N], dtype=tl.float32), lo, x_ptr, z_ptr, s_ptr, m_ptr,
                      k_start, offs_n, mask_n, offs_r, stride_z, stride_s, expo, GROUP, BITS,
                      HAS_MIN, BLOCK_N, R)  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_start + K_SPLIT, BLOCK_K):
        lo = tl.load(w_ptrs + (k0 // PACK) * stride_q, mask=mask_n[None, :], other=0)
        acc = _gemv1_tile(acc, lo, x_ptr, z_ptr, s_ptr, m_ptr, k0, offs_n, mask_n, offs_r,
                          stride_z, stride_s, expo, GROUP, BITS, HAS_MIN, BLOCK_N, R)  # fmt: skip
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        split_fixup(acc[None, :], ws_ptr, cnt_ptr, b_ptr, out_ptr, tl.arange(0, 1), offs_n,
                    tl.full([1], 1, tl.int1), mask_n, 1, N, N, tl.program_id(0), tl.program_id(1),
                    HAS_BIAS, SPLIT, 1, BLOCK_N)  # fmt: skip


def _fit_block_k(block_k: int, k: int, group: int) -> int:
    """A K tile inside one group where the group is a power of two (one row of scales and zeros
    per tile instead of one per weight row)."""
    block_k = min(block_k, triton.next_power_of_2(k))
    return group if group < block_k and group & (group - 1) == 0 else block_k


def _check(x, qweight, zeros, scales, mins, group: int, bits: int) -> tuple[int, int, int]:
    m, k = x.shape
    n = qweight.shape[1]
    if bits not in (4, 8) or qweight.shape[0] * (32 // bits) != k or k % group:
        raise ValueError(
            f"w4a16: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, bits {bits}, "
            f"group {group} do not fit"
        )
    g = k // group
    assert (
        zeros.shape == (g, n)
        and scales.shape == (g, n)
        and zeros.dtype in (torch.uint8, torch.int16)
    )
    assert mins is None or (mins.shape == scales.shape and mins.stride() == scales.stride())
    assert qweight.dtype == torch.int32 and qweight.stride(-1) == 1 and x.stride(-1) == 1
    return m, n, k


def _operands(x, qweight, zeros, scales, mins, group, bits) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with unit stride along K, checked against the packed weight, and the output."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, n, _ = _check(x, qweight, zeros, scales, mins, group, bits)
    return x, torch.empty((m, n), dtype=x.dtype, device=x.device)


def gemm_config(m: int) -> tuple[int, ...]:
    return GEMM_CONFIG if m <= GEMM_LARGE_ROWS else GEMM_CONFIG_LARGE


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The device's split-K counters, one per output tile, all zero between launches (each
    tile's last program resets its own). Launches on one stream run one after another, so one
    set serves every layer. A larger set, where one is ever needed, joins the older ones
    rather than replacing them: CUDA graphs captured earlier keep their addresses."""
    sets = _COUNTERS.setdefault(device, [])
    if not sets or sets[-1].numel() < programs:
        sets.append(torch.zeros(max(programs, 1 << 14), dtype=torch.int32, device=device))
    return sets[-1]


def auto_split(
    k: int, programs: int, block_k: int, sms: int, per_sm: int = 8, min_tiles: int = 4,
    max_split: int = 1 << 30,
) -> int:
    """Split K (a power of two) until about ``per_sm`` programs per SM stream the weight: one
    program per strip of N columns leaves a narrow layer (N = 4,096 at a 32-column strip: 128
    programs) with one program per SM, too few loads in flight to draw HBM's bandwidth. Each
    split keeps at least ``min_tiles`` K tiles, and K must divide evenly.
    ``benchmarks/w4a16_bench.py`` sweeps ``split_k``; BENCHMARKS.md gives the figures this rule
    was read from."""
    split = 1
    while (
        programs * split < per_sm * sms
        and 2 * split <= max_split
        and k % (2 * split * block_k) == 0
        and k // (2 * split) >= min_tiles * block_k
    ):
        split *= 2
    return split


def _one_row_block_k(block_k: int, k: int, group: int, bits: int) -> int:
    """The one-row kernel's K tile: a power of two inside one group (its scale and zero come
    out of the tile's sum), at least one packed word, dividing K; 0 where none fits."""
    bk = min(block_k, triton.next_power_of_2(k))
    while bk >= 32 // bits and (group % bk or k % bk):
        bk //= 2
    return bk if bk >= 32 // bits else 0


def gemv(
    x: torch.Tensor,  # [M, K], a few rows
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int = 4,
    config: tuple[int, ...] | None = None,  # (block_n, block_k, num_warps[, split_k])
    mins: torch.Tensor | None = None,
    one_row: bool | None = None,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
) -> torch.Tensor:
    """``x @ dequant(W) (+ bias)`` for a few rows of ``x``, in ``x``'s dtype.

    One row (``one_row``, default: when ``x`` has one row and a K tile fits inside a group)
    runs ``_gemv1_kernel``, which takes the group's scale and zero out of its sums; more rows
    run ``_gemv_kernel``, which dequantizes each weight. ``split_k`` (default on CUDA:
    :func:`auto_split`) runs that many programs per strip of columns, each over its share of
    K; the strip's last program adds their fp32 partial sums in a fixed order
    (:func:`split_fixup`: results are the same run to run, unlike atomic adds)."""
    x, out = _operands(x, qweight, zeros, scales, mins, group, bits)
    m, n, k = x.shape[0], out.shape[1], x.shape[1]
    if m == 0:
        return out
    cfg1 = config or (GEMV1_CONFIG if x.is_cuda else INTERPRET_GEMV1_CONFIG)
    block_k1 = _one_row_block_k(cfg1[1], k, group, bits)
    if one_row is None:
        one_row = m == 1 and block_k1 > 0
    if one_row:
        cfg = cfg1
        block_n, _, warps = cfg[:3]
        block_k = block_k1
        if m != 1 or not block_k:
            raise ValueError(f"w4a16: the one-row GEMV takes one row and a K tile inside a "
                             f"group; got {m} rows, K = {k}, group {group}")  # fmt: skip
        per_sm, min_tiles = 16, 2  # one-warp programs: more of them, shorter
    else:
        cfg = config or (GEMV_CONFIG if x.is_cuda else INTERPRET_GEMV_CONFIG)
        block_n, block_k, warps = cfg[:3]
        block_k = max(32 // bits, _fit_block_k(block_k, k, group))
        per_sm, min_tiles = 8, 4
    programs = triton.cdiv(n, block_n)
    if len(cfg) > 3:
        split = cfg[3]
    elif x.is_cuda:
        split = auto_split(k, programs, block_k, sm_count(x.device.index), per_sm, min_tiles)
    else:
        split = 1
    if split < 1 or k % (split * block_k):
        raise ValueError(f"w4a16: split_k {split} x block_k {block_k} does not divide K = {k}")
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    counters = out if split == 1 else split_counters(x.device, programs)
    common = dict(GROUP=group, BITS=bits, HAS_MIN=mins is not None, HAS_BIAS=bias is not None,
                  SPLIT=split, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)  # fmt: skip
    operands = (x, qweight, zeros, scales, mins if mins is not None else scales,
                bias if bias is not None else scales, out, ws, counters)  # fmt: skip
    if one_row:  # released before its wait, as the bf16 GEMV (``kernels/gemv.py``)
        mode = pdl.mode(x, programs * split, pdl_cfg, early=True)
        _gemv1_kernel[(programs, split)](
            *operands, n, k // split, qweight.stride(0), zeros.stride(0), scales.stride(0),
            _EXPO, PDL=mode, **common, **pdl.launch_options(mode),
        )  # fmt: skip
    else:
        _gemv_kernel[(programs, split)](
            *operands, m, n, k, k // split, x.stride(0), qweight.stride(0), zeros.stride(0),
            scales.stride(0), out.stride(0), BLOCK_M=triton.next_power_of_2(m), **common,
        )  # fmt: skip
    return out


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
    x, out = _operands(x, qweight, zeros, scales, mins, group, bits)
    m, n, k = x.shape[0], out.shape[1], x.shape[1]
    if m == 0:
        return out
    if config is None:
        config = gemm_config(m) if x.is_cuda else INTERPRET_GEMM_CONFIG
    bm, bn, bk, warps = config[:4]
    stages = {"num_stages": config[4]} if len(config) > 4 and config[4] else {}  # 0: default
    bk = max(16, _fit_block_k(bk, k, group))
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
    bk = max(32 // bits, _fit_block_k(bk, k, group))
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
    _check(x, qweight, zeros, scales, mins, group, bits)
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
