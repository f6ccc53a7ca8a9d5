"""Fused mixture-of-experts MLP: two grouped GEMM launches over tokens sorted by expert.

With the (token, slot) pairs grouped into one-expert tiles (``kernels/moe_routing.py``)::

    gate_up   program (tile m, columns n):  h[pair, n] = silu(x[token] . w13[e, n])
                                                         * (x[token] . w13[e, I + n])
    down      program (tile m, columns n):  y[pair, n] = weight[pair] * (h[pair] . w2[e, n])
    combine   out[token] = sum over its k slots of y[token * k + slot]

Each tile reads its expert's weight columns once for up to ``BLOCK_M`` rows; the gate and up
columns of one ``n`` share the tile's activation loads and SiLU-and-mul runs on the fp32
accumulators, so the ``[pairs, 2I]`` intermediate is never written. The routing weight is
applied in the down GEMM's epilogue. Padding rows (index ``T * k``) load zeros and store
nothing; tiles past ``num_tokens_post_padded`` return at once, so the grid (sized by
``align_capacity``) never depends on the routing and a CUDA graph can hold it.

FP8 experts: ``w13``/``w2`` in float8 e4m3 with one fp32 scale per output row and expert
(``[E, 2I]`` / ``[E, H]``). At a few rows per expert (decode) a tile widens its weight block to
the activations' dtype in registers and scales the accumulator's columns (weight-only: a step
reads half the bytes). Widening costs instructions per weight that many rows per tile no longer
hide, so from ``act_fp8_rows`` rows per expert on average the activations are quantized per row
to e4m3 as well (as the dense FP8 layers do from a few rows on) and both operands go to FP8
tensor cores; the epilogue applies the row's and the column's scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.kernels.moe_routing import moe_align_block_size
from fulcrum.kernels.quant_fp8 import per_token_quant_fp8, per_token_quant_fp8_ref


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    a_scale_ptr,
    route_w_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    N,  # output columns (I for the gated GEMM, whose weight has 2I rows)
    K,
    num_pairs,
    num_tiles_m,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    A_ROW_DIV: tl.constexpr,  # a pair's row of A: pair // A_ROW_DIV (k: x by token; 1: h)
    GATED: tl.constexpr,
    ROUTED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    A_FP8: tl.constexpr,  # A in e4m3 with one scale per row: FP8 x FP8 products
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: neighbouring programs share an expert's weight columns in L2.
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    up_off = N * stride_bn  # the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if not A_FP8:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
        if GATED:
            b_up = tl.load(b_ptrs + up_off, mask=b_mask, other=0.0)
            if not A_FP8:
                b_up = b_up.to(a.dtype)
            acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_SCALE:
        s_ptrs = scale_ptr + expert * stride_se + offs_n
        acc *= tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_ptrs + N, mask=n_ok, other=0.0)[None, :]
    if A_FP8:
        a_s = tl.load(a_scale_ptr + pair // A_ROW_DIV, mask=valid, other=0.0)[:, None]
        acc *= a_s
        if GATED:
            acc_up *= a_s
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if ROUTED:
        acc *= tl.load(route_w_ptr + pair, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
MoeLaunch = tuple[int, int, int, int, int]


def default_launch(num_pairs: int, num_experts: int, on_cuda: bool) -> MoeLaunch:
    """Tile sizes by the rows an expert gets on average: few rows (decode) stream the weights
    through 16-row tiles; many rows (prefill) take larger tiles for tensor-core reuse."""
    if not on_cuda:
        return (16, 32, 32, 1, 1)  # the interpreter: small tiles, fewer wasted lanes
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return (16, 64, 128, 4, 3)
    if per_expert <= 64:
        return (32, 64, 128, 4, 3)
    if per_expert <= 256:
        return (64, 128, 64, 8, 3)
    return (128, 128, 64, 8, 3)


def _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    t, h = x.shape
    e, two_i, h2 = w13.shape
    if h2 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
            "do not fit [T, H], [E, 2I, H], [E, H, I]."
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(
            f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [T={t}, k]."
        )
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe: give both expert weight scales or neither.")
    if w13_scale is not None and (
        tuple(w13_scale.shape) != (e, two_i) or tuple(w2_scale.shape) != (e, h)
    ):
        raise ValueError(
            f"fused_moe: scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} must be "
            f"[E, 2I] = {(e, two_i)} / [E, H] = {(e, h)}."
        )


def _gemm(a, w, out, scale, route_w, align, n, row_div, gated, launch: MoeLaunch,
          a_scale: torch.Tensor | None = None) -> None:  # fmt: skip
    sorted_ids, expert_ids, num_post_pad = align
    bm, bn, bk, warps, stages = launch
    tiles_m = expert_ids.numel()
    grid = (tiles_m * triton.cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        a, w, out, scale if scale is not None else w, a_scale if a_scale is not None else w,
        route_w if route_w is not None else a, sorted_ids, expert_ids, num_post_pad, n,
        a.shape[1], out.shape[0], tiles_m, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        scale.stride(0) if scale is not None else 0, A_ROW_DIV=row_div, GATED=gated,
        ROUTED=route_w is not None, HAS_SCALE=scale is not None, A_FP8=a_scale is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32: FP8 experts' row scales
    w2_scale: torch.Tensor | None = None,  # [E, H]
    launch: MoeLaunch | None = None,
    act_fp8_rows: int = 0,
) -> torch.Tensor:
    """``sum_slot weight[t, slot] * expert_{id[t, slot]}(x[t])`` for every token: ``[T, H]``
    in ``x``'s dtype. FP8 experts with at least ``act_fp8_rows`` (token, slot) pairs per expert
    on average (0: never) take FP8 activations too (``kernels/quant_fp8.py``, per row)."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights: rows must be contiguous"
    if t == 0:
        return torch.empty_like(x)
    launch = launch or default_launch(t * k, e, x.is_cuda)
    align = moe_align_block_size(topk_ids, e, launch[0])
    pairs = t * k
    act_fp8 = w13_scale is not None and 0 < act_fp8_rows <= pairs / e
    # Triton's interpreter rounds some float-to-e4m3 casts down across a power of two (124.8
    # to 64): off CUDA, torch quantizes.
    quant = per_token_quant_fp8 if x.is_cuda else per_token_quant_fp8_ref
    a, a_scale = quant(x) if act_fp8 else (x, None)
    h_act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gemm(a, w13, h_act, w13_scale, None, align, inter, k, True, launch, a_scale)
    h_in, h_scale = quant(h_act) if act_fp8 else (h_act, None)
    y = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gemm(h_in, w2, y, w2_scale, route_w, align, h, 1, False, launch, h_scale)
    return y if k == 1 else y.view(t, k, h).sum(dim=1)
