"""Rotary position embedding, neox / Hugging Face ``rotate_half`` style, applied in place.

``cos_sin_cache[pos]`` holds ``[cos_0 .. cos_{R/2-1} | sin_0 .. sin_{R/2-1}]`` for a rotary dim
``R`` (normally ``R == head_dim``; a smaller ``R`` rotates only the first ``R`` dims). Each head
row splits into halves ``x1 = x[:R/2]``, ``x2 = x[R/2:R]``::

    out[:R/2]  = x1 * cos - x2 * sin
    out[R/2:R] = x2 * cos + x1 * sin        (= x * cos + rotate_half(x) * sin)

One program per token rotates all its query and key heads; math in fp32. Given the step's KV
cache and slots, the same program then writes the token's rotated K and its V into the cache
(what ``reshape_and_cache`` does), saving a launch per layer. Given ``qk_norm`` (Qwen3's RMSNorm
over each head of q and of k before rotary), the same program first normalizes each head as
``kernels/rmsnorm.py`` does (the normed row rounded to the dtype, then the weight), saving the
two norms' launches and the copies of q and k they read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.reshape_and_cache import cache_args, store_kv_row


@triton.jit
def _rotate_rows(
    x_ptr,
    row_off,
    stride_h,
    cos,
    sin,
    w_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,  # RMSNorm each head (rotary over the whole head) with w_ptr's weight
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask_r = offs_r < HALF
    mask = (offs_h[:, None] < NUM_HEADS) & mask_r[None, :]
    p1 = x_ptr + row_off + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:  # as rmsnorm.py: statistics in fp32, normed row rounded, times the weight, rounded
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    WRITE_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr = False,
    qw_ptr=None,  # NORM: the q and k heads' RMSNorm weights [HEAD_DIM] and eps
    kw_ptr=None,
    eps=0.0,
):
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)
    mask_r = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_r, mask=mask_r, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_r, mask=mask_r, other=0.0)[None, :]
    _rotate_rows(q_ptr, t * stride_qt, stride_qh, cos, sin, qw_ptr, eps, NUM_Q_HEADS, HALF,
                 BLOCK_HQ, BLOCK_HALF, NORM)  # fmt: skip
    _rotate_rows(k_ptr, t * stride_kt, stride_kh, cos, sin, kw_ptr, eps, NUM_K_HEADS, HALF,
                 BLOCK_HK, BLOCK_HALF, NORM)  # fmt: skip
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            tl.debug_barrier()  # the rotated K rows (stored by other threads) are visible
            store_kv_row(
                k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, t, slot, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_cb, stride_co, stride_ch, NUM_K_HEADS, HEAD_DIM, BLOCK_SIZE,
                BLOCK_HK, BLOCK_D, FP8, V_TOKEN_MAJOR,
            )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32: [cos | sin]
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place by their tokens' positions; returns ``(q, k)``.

    ``q``/``k`` may be strided views (slices of a fused qkv output) with ``head_dim`` contiguous.
    ``kv_write = (v, kv_cache, slot_mapping)`` also writes the rotated ``k`` and ``v`` into the
    paged cache, as :func:`~fulcrum.kernels.reshape_and_cache.reshape_and_cache` would.
    ``qk_norm = (q_weight, k_weight, eps)`` first RMSNorms every head of q and of k (the rotary
    dim must then be the head dim).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot = cos_sin_cache.shape[1]
    assert rot % 2 == 0 and rot <= head_dim and k.shape[0] == num_tokens
    if qk_norm is not None and rot != head_dim:
        raise ValueError(f"apply_rotary: qk_norm needs rotary over the whole head ({rot} of {head_dim})")
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return q, k
    if kv_write is None:
        v = k_cache = v_cache = slots = q  # unused
        strides = [0] * 5
        consts = dict(HEAD_DIM=head_dim, BLOCK_SIZE=1, BLOCK_D=1, FP8=False, V_TOKEN_MAJOR=False)
    else:
        v, cache, slots = kv_write
        assert slots.shape[0] >= num_tokens
        strides, consts = cache_args(k, v, cache)
        strides = strides[2:]  # k's own strides are passed above
        del consts["NUM_KV_HEADS"], consts["BLOCK_H"]
        k_cache, v_cache = cache[0], cache[1]
    m = pdl.mode(q, num_tokens, pdl_cfg)
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        v,
        k_cache,
        v_cache,
        slots,
        *strides,
        WRITE_KV=kv_write is not None,
        **consts,
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        HALF=rot // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(rot // 2),
        PDL=m,
        NORM=qk_norm is not None,
        qw_ptr=qk_norm[0] if qk_norm else None,
        kw_ptr=qk_norm[1] if qk_norm else None,
        eps=qk_norm[2] if qk_norm else 0.0,
        num_warps=4,
        **pdl.launch_options(m),
    )
    return q, k


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of :func:`apply_rotary` (out of place, fp32 math)."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, R/2] each
    cos = torch.cat([cos, cos], -1)[:, None, :]
    sin = torch.cat([sin, sin], -1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rot].float()
        x1, x2 = xr.chunk(2, dim=-1)
        out = xr * cos + torch.cat([-x2, x1], -1) * sin
        return torch.cat([out.to(x.dtype), x[..., rot:]], -1)

    return rotate(q), rotate(k)
