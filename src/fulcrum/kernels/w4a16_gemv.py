"""Weight-only integer GEMV: ``y = x @ dequant(W) (+ b)`` for one to a few rows of x, with W
packed as ``w4a16_common.py`` lays it out. Products are summed in fp32 without ``tl.dot``
(whose M tile would be mostly padding), each program streaming a strip of N columns; the
weight is dequantized in registers right after its load, so memory streams only the packed
words (a quarter of bf16's bytes at 4 bits, plus one scale and zero per group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.gemv import rope_epilogue
from fulcrum.kernels.pdl import sm_count
from fulcrum.kernels.w4a16_common import (
    auto_split,
    check,
    check_operands,
    dequant_tile,
    fit_block_k,
    gemv_step,
    split_arrive,
    split_counters,
    split_fixup,
    split_total,
    store_tile,
)

# (block_n, block_k, num_warps) on CUDA; not tuned (benchmarks/w4a16_bench.py sweeps them)
GEMV_CONFIG = (32, 256, 4)
# One row of x (batch-1 decode): (block_n, block_k, num_warps); block_k shrinks to fit the group.
# The fastest of w4a16_bench.py's sweep over the 8B's four linears on an H100 (BENCHMARKS §9.2).
GEMV1_CONFIG = (128, 64, 1)
INTERPRET_GEMV1_CONFIG = (16, 16, 1)
_EXPO = 150 << 23  # float bits of 2**23 (``_gemv1_kernel``'s ``expo``)
INTERPRET_GEMV_CONFIG = (16, 16, 1)
# The one-row kernel's epilogue constexprs for a plain projection (``silu_gemv1`` and
# ``rope_gemv1`` replace them).
PLAIN_EPILOGUE = dict(SILU=False, ROPE=False, HEAD_DIM=1, NUM_Q_HEADS=0, NUM_KV_HEADS=0, PAGE=1,
                      KV_FP8=False, V_TOKEN_MAJOR=False)  # fmt: skip


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
        w = dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K,
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
def _nibbles(w, FAST: tl.constexpr):
    """The eight 4-bit values of each int32 of ``w`` as fp32 multiples of 2**-24, in the order
    values 0, 4, 2, 6 (``q * 2**-24``), then 1, 5, 3, 7 (``16 q * 2**-24``): each AND leaves
    two values as the mantissas of a pair of f16 subnormals, which widen to fp32 exactly. Per
    weight: half a logic instruction and one conversion, and no offset to subtract (a value
    OR'd under an exponent, ``int_minus``, needs an add per weight to take it off). With
    ``FAST`` (CUDA) as inline PTX; elsewhere the same values by integer arithmetic."""
    if FAST:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, c, d, s;
            .reg .f16 a0, a1, b0, b1, c0, c1, d0, d1;
            and.b32 a, $8, 0x000f000f;
            and.b32 b, $8, 0x00f000f0;
            shr.u32 s, $8, 8;
            and.b32 c, s, 0x000f000f;
            and.b32 d, s, 0x00f000f0;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            mov.b32 {c0, c1}, c;
            mov.b32 {d0, d1}, d;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, c0;
            cvt.f32.f16 $3, c1;
            cvt.f32.f16 $4, b0;
            cvt.f32.f16 $5, b1;
            cvt.f32.f16 $6, d0;
            cvt.f32.f16 $7, d1;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [w],
            dtype=(tl.float32,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        u = 5.9604644775390625e-08  # 2**-24
        return (
            (w & 0xF).to(tl.float32) * u,
            ((w >> 16) & 0xF).to(tl.float32) * u,
            ((w >> 8) & 0xF).to(tl.float32) * u,
            ((w >> 24) & 0xF).to(tl.float32) * u,
            (w & 0xF0).to(tl.float32) * u,
            ((w >> 16) & 0xF0).to(tl.float32) * u,
            ((w >> 8) & 0xF0).to(tl.float32) * u,
            ((w >> 24) & 0xF0).to(tl.float32) * u,
        )


@triton.jit
def _gemv1_tile(acc, lo, x_ptr, z_ptr, s_ptr, m_ptr, k0, offs_n, mask_n, offs_r, stride_z, stride_s,
                expo, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                BLOCK_N: tl.constexpr, R: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """``acc`` plus one K tile of :func:`_gemv1_kernel`: ``lo`` holds the tile's packed words."""
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    MASK: tl.constexpr = (1 << BITS) - 1
    xsum = tl.zeros([R], dtype=tl.float32)
    if BITS == 4:  # see _nibbles: part = 2**24 (pa + pb / 16)
        v0, v4, v2, v6, v1, v5, v3, v7 = _nibbles(lo, FAST)
        xr = x_ptr + k0 + offs_r * 8
        x0 = tl.load(xr).to(tl.float32)
        x4 = tl.load(xr + 4).to(tl.float32)
        x2 = tl.load(xr + 2).to(tl.float32)
        x6 = tl.load(xr + 6).to(tl.float32)
        x1 = tl.load(xr + 1).to(tl.float32)
        x5 = tl.load(xr + 5).to(tl.float32)
        x3 = tl.load(xr + 3).to(tl.float32)
        x7 = tl.load(xr + 7).to(tl.float32)
        ta = v0 * x0[:, None]  # each (row, column) a multiply-add chain: no products held apart
        ta += v4 * x4[:, None]
        ta += v2 * x2[:, None]
        ta += v6 * x6[:, None]
        tb = v1 * x1[:, None]
        tb += v5 * x5[:, None]
        tb += v3 * x3[:, None]
        tb += v7 * x7[:, None]
        part = (tl.sum(ta, axis=0) + tl.sum(tb, axis=0) * 0.0625) * 16777216.0
        xsum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    else:
        hi = (lo.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
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
def _gemv1_finish(acc, offs_n, mask_n, b_ptr, out_ptr, N, pos_ptr, cs_ptr, stride_cs, slot_ptr,
                  kc_ptr, vc_ptr, stride_cb, stride_co, stride_ch, HAS_BIAS: tl.constexpr,
                  SILU: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                  KV_FP8: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The program's summed columns ``acc`` [BLOCK_N] (its physical columns ``offs_n``) into
    the output: plain, or with the epilogue of ``kernels/gemv.py``'s ``silu_gemv`` (the first
    half of the columns gate, the second the matching up columns) or ``rope_gemv`` (whole
    heads, rotary pairs d and d + HEAD_DIM / 2 reordered side by side as its epilogue takes
    them)."""
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SILU:  # as silu_and_mul computes it from gate_up's rounded output
        HB: tl.constexpr = BLOCK_N // 2
        g, u = tl.split(tl.permute(tl.reshape(acc.to(dt).to(tl.float32), [2, HB]), (1, 0)))
        offs_o = pid * HB + tl.arange(0, HB)
        tl.store(out_ptr + offs_o, (g / (1.0 + tl.exp(-g)) * u).to(dt), mask=offs_o < N)
    elif ROPE:
        H: tl.constexpr = BLOCK_N // HEAD_DIM
        pairs = tl.permute(tl.reshape(acc, [H, 2, HEAD_DIM // 2]), (0, 2, 1))
        rope_epilogue(
            tl.reshape(pairs, [1, BLOCK_N]), pid, N, tl.arange(0, 1), tl.full([1], 1, tl.int1),
            out_ptr, 0, pos_ptr, cs_ptr, stride_cs, slot_ptr, kc_ptr, vc_ptr, stride_cb,
            stride_co, stride_ch, HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS, PAGE, KV_FP8,
            V_TOKEN_MAJOR, 1, BLOCK_N,
        )  # fmt: skip
    else:
        tl.store(out_ptr + offs_n, acc.to(dt), mask=mask_n)


@triton.jit
def _gemv1_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, m_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, N, K_SPLIT,
                  stride_q, stride_z, stride_s, expo, pos_ptr, cs_ptr, stride_cs, slot_ptr,
                  kc_ptr, vc_ptr, stride_cb, stride_co, stride_ch, GROUP: tl.constexpr,
                  BITS: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr, FAST: tl.constexpr, SILU: tl.constexpr,
                  ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr,
                  V_TOKEN_MAJOR: tl.constexpr):  # fmt: skip
    """One row of x. A tile lies inside one group, so its scale and zero come out of the sum:
    ``sum_k x_k (q_k - z) s + m sum_k x_k = s (sum_k x_k q_k - z sum_k x_k) + m sum_k x_k``,
    leaving about four instructions per weight in the compiled loop (mask, exact float, fused
    multiply-add, a share of x's loads) where dequantize-then-multiply takes about nine
    (``benchmarks/kernel_resources.py --kernel w4a16``): the K loop is bound by instructions
    issued per weight byte, not by memory. Each thread holds all rows of its columns' words, so the
    sum over K stays in registers. 4-bit values become floats two per logic instruction as
    f16 subnormals (``_nibbles``); 8-bit ones without a conversion instruction (see
    ``int_minus``): masked in place in the low or high half-word, OR'd with
    the exponent that makes their unit 1, minus that power of two. ``expo`` (always
    ``150 << 23``, the bits of 2**23) arrives as an argument so that the exponents stay in
    registers: with both mask and exponent as immediates the compiler spends two logic
    instructions per weight instead of one.

    Launched with PDL (``kernels/pdl.py``), the first tile's words are read before the wait
    (weights are never written during a step), so they stream while the kernel before
    finishes; the first tile is peeled off the loop to keep them in registers.

    ``SILU``: the weight is gate_up's (2N columns); a program owns N-columns ``[p B/2, (p+1)
    B/2)`` of the gate and the same of up, and stores their SiLU-and-mul (N columns).
    ``ROPE``: the weight is qkv's; a program owns whole heads, applies rotary to q and k and
    writes the K/V rows into the paged cache (``_gemv1_finish``)."""
    PACK: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PACK
    if SILU:
        j = tl.arange(0, BLOCK_N)
        col = tl.program_id(0) * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        offs_n = col + (j // (BLOCK_N // 2)) * N
        mask_n = col < N
        n_cols = 2 * N
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        n_cols = N
    offs_r = tl.arange(0, R)
    k_start = tl.program_id(1) * K_SPLIT
    w_ptrs = qw_ptr + offs_r[:, None] * stride_q + offs_n[None, :]
    lo = tl.load(w_ptrs + (k_start // PACK) * stride_q, mask=mask_n[None, :], other=0)
    pdl.wait(PDL)
    acc = _gemv1_tile(tl.zeros([BLOCK_N], dtype=tl.float32), lo, x_ptr, z_ptr, s_ptr, m_ptr,
                      k_start, offs_n, mask_n, offs_r, stride_z, stride_s, expo, GROUP, BITS,
                      HAS_MIN, BLOCK_N, R, FAST)  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_start + K_SPLIT, BLOCK_K):
        lo = tl.load(w_ptrs + (k0 // PACK) * stride_q, mask=mask_n[None, :], other=0)
        acc = _gemv1_tile(acc, lo, x_ptr, z_ptr, s_ptr, m_ptr, k0, offs_n, mask_n, offs_r,
                          stride_z, stride_s, expo, GROUP, BITS, HAS_MIN, BLOCK_N, R,
                          FAST)  # fmt: skip
    last = True
    if SPLIT > 1:
        pid = tl.program_id(0)
        last = split_arrive(acc, ws_ptr, cnt_ptr, offs_n, mask_n, n_cols, pid, tl.program_id(1),
                            SPLIT)  # fmt: skip
        if last:
            acc = split_total(acc, ws_ptr, cnt_ptr, offs_n, mask_n, n_cols, pid, SPLIT)
    if last:
        _gemv1_finish(acc, offs_n, mask_n, b_ptr, out_ptr, N, pos_ptr, cs_ptr, stride_cs,
                      slot_ptr, kc_ptr, vc_ptr, stride_cb, stride_co, stride_ch, HAS_BIAS, SILU,
                      ROPE, HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS, PAGE, KV_FP8, V_TOKEN_MAJOR,
                      BLOCK_N)  # fmt: skip


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
    x, out = check_operands(x, qweight, zeros, scales, mins, group, bits)
    m, n, k = x.shape[0], out.shape[1], x.shape[1]
    if m == 0:
        return out
    cfg1 = config or (GEMV1_CONFIG if x.is_cuda else INTERPRET_GEMV1_CONFIG)
    block_k1 = _one_row_block_k(cfg1[1], k, group, bits)
    if one_row is None:
        one_row = m == 1 and block_k1 > 0
    if one_row:
        if m != 1 or not block_k1:
            raise ValueError(f"w4a16: the one-row GEMV takes one row and a K tile inside a "
                             f"group; got {m} rows, K = {k}, group {group}")  # fmt: skip
        return _launch1(x, out, qweight, zeros, scales, mins, bias, group, bits, cfg1, block_k1,
                        n, pdl_cfg)  # fmt: skip
    cfg = config or (GEMV_CONFIG if x.is_cuda else INTERPRET_GEMV_CONFIG)
    block_n, block_k, warps = cfg[:3]
    block_k = max(32 // bits, fit_block_k(block_k, k, group))
    programs = triton.cdiv(n, block_n)
    split = _split(cfg, x, k, programs, block_k, 8, 4)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    counters = out if split == 1 else split_counters(x.device, programs)
    _gemv_kernel[(programs, split)](
        x, qweight, zeros, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, out, ws, counters, m, n, k, k // split,
        x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0), out.stride(0),
        GROUP=group, BITS=bits, HAS_MIN=mins is not None, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


def _split(cfg: tuple[int, ...], x: torch.Tensor, k: int, programs: int, block_k: int,
           per_sm: int, min_tiles: int) -> int:  # fmt: skip
    if len(cfg) > 3:
        split = cfg[3]
    elif x.is_cuda:
        split = auto_split(k, programs, block_k, sm_count(x.device.index), per_sm, min_tiles)
    else:
        split = 1
    if split < 1 or k % (split * block_k):
        raise ValueError(f"w4a16: split_k {split} x block_k {block_k} does not divide K = {k}")
    return split


def _launch1(x, out, qweight, zeros, scales, mins, bias, group, bits, cfg, block_k, n, pdl_cfg,
             epilogue: dict | None = None, rope_args: tuple = ()) -> torch.Tensor:  # fmt: skip
    """The one-row kernel over ``n`` output columns (``epilogue``: its SILU / ROPE
    constexprs, ``rope_args`` the cache operands). One-warp programs: more of them, shorter,
    so split-K runs up to 16 programs per SM."""
    epilogue = {**PLAIN_EPILOGUE, **(epilogue or {})}
    k = x.shape[1]
    block_n, _, warps = cfg[:3]
    per_program = block_n // 2 if epilogue["SILU"] else block_n
    programs = triton.cdiv(n, per_program)
    split = _split(cfg, x, k, programs, block_k, 16, 2)
    cols = qweight.shape[1]  # the weight's columns: 2n for SILU
    ws = out if split == 1 else torch.empty((split, cols), dtype=torch.float32, device=x.device)
    counters = out if split == 1 else split_counters(x.device, programs)
    if not rope_args:
        rope_args = (out, out, 0, out, out, out, 0, 0, 0)
    # released before its wait, as the bf16 GEMV (``kernels/gemv.py``)
    mode = pdl.mode(x, programs * split, pdl_cfg, early=True)
    _gemv1_kernel[(programs, split)](
        x, qweight, zeros, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, out, ws, counters, n, k // split,
        qweight.stride(0), zeros.stride(0), scales.stride(0), _EXPO, *rope_args, GROUP=group,
        BITS=bits, HAS_MIN=mins is not None, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=mode, FAST=x.is_cuda, num_warps=warps,
        **epilogue, **pdl.launch_options(mode),
    )  # fmt: skip
    return out


def one_row_fits(x: torch.Tensor, k: int, group: int, bits: int) -> bool:
    """Whether ``x`` is one row the one-row kernel (and so its epilogues) takes."""
    cfg = GEMV1_CONFIG if x.is_cuda else INTERPRET_GEMV1_CONFIG
    return x.dim() == 2 and x.shape[0] == 1 and _one_row_block_k(cfg[1], k, group, bits) > 0


def silu_gemv1(x, qweight, zeros, scales, bias, group, bits=4, mins=None,
               pdl_cfg: PdlConfig = pdl.DEFAULT, config: tuple[int, ...] | None = None,
               ) -> torch.Tensor:  # fmt: skip
    """``silu_and_mul(gemv(x, ...))`` for one row of ``x`` against gate_up's packed weight
    (gate columns, then up columns): ``[1, N]`` in one kernel, as ``kernels/gemv.silu_gemv``
    for bf16 and FP8 weights."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    check(x, qweight, zeros, scales, mins, group, bits)
    if qweight.shape[1] % 2:
        raise ValueError(f"silu_gemv1: gate and up columns, got {qweight.shape[1]} columns")
    n = qweight.shape[1] // 2
    cfg = config or (GEMV1_CONFIG if x.is_cuda else INTERPRET_GEMV1_CONFIG)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_k = _one_row_block_k(cfg[1], x.shape[1], group, bits)
    return _launch1(x, out, qweight, zeros, scales, mins, bias, group, bits, cfg, block_k, n,
                    pdl_cfg, {"SILU": True})  # fmt: skip


def rope_gemv1(x, qweight, zeros, scales, bias, group, bits, mins, positions, cos_sin_cache,
               kv_cache, slot_mapping, num_heads: int, num_kv_heads: int,
               pdl_cfg: PdlConfig = pdl.DEFAULT, config: tuple[int, ...] | None = None,
               ) -> torch.Tensor:  # fmt: skip
    """qkv's one-row projection with rotary on its q and k heads and its K/V rows written into
    the paged cache, in one kernel, as ``kernels/gemv.rope_gemv`` for bf16 and FP8 weights.
    Each program owns whole heads: the kernel's column tile widens to the head where it is
    narrower (a power-of-two head dim)."""
    from fulcrum.kv_cache.dtype import is_fp8, v_token_major

    x, out = check_operands(x, qweight, zeros, scales, mins, group, bits)
    head_dim = cos_sin_cache.shape[1]
    n = out.shape[1]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or head_dim & (head_dim - 1):
        raise ValueError(
            f"rope_gemv1: {n} columns for {num_heads} + 2 x {num_kv_heads} heads of {head_dim} "
            "(a power-of-two head dim)"
        )
    cfg = config or (GEMV1_CONFIG if x.is_cuda else INTERPRET_GEMV1_CONFIG)
    cfg = (max(cfg[0], head_dim), *cfg[1:])
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
    assert cos_sin_cache.stride(-1) == 1 and slot_mapping.shape[0] >= 1
    rope_args = (positions, cos_sin_cache, cos_sin_cache.stride(0), slot_mapping, k_cache,
                 v_cache, *k_cache.stride()[:3])  # fmt: skip
    epilogue = dict(ROPE=True, HEAD_DIM=head_dim, NUM_Q_HEADS=num_heads,
                    NUM_KV_HEADS=num_kv_heads, PAGE=k_cache.shape[1],
                    KV_FP8=is_fp8(kv_cache.dtype), V_TOKEN_MAJOR=v_token_major(kv_cache.dtype))  # fmt: skip
    block_k = _one_row_block_k(cfg[1], x.shape[1], group, bits)
    return _launch1(x, out, qweight, zeros, scales, mins, bias, group, bits, cfg, block_k, n,
                    pdl_cfg, epilogue, rope_args)  # fmt: skip
