"""Scatter new K/V rows into the paged KV cache.

One program per new token ``t``; ``slot_mapping[t] = block * block_size + offset`` names where its
row goes (``-1``: a padding token, skipped)::

    k[t] : [num_kv_heads, head_dim]  ──►  kv_cache[0, block, offset] : [num_kv_heads, head_dim]
    v[t] : [num_kv_heads, head_dim]  ──►  kv_cache[1, block, offset] : [num_kv_heads, head_dim]

An FP8 cache gets saturated values, and its V blocks are token-major (``[num_kv_heads, head_dim,
block_size]``: see ``fulcrum.kv_cache.dtype``), so token ``t``'s V values land ``block_size``
apart. ``k`` and ``v`` may be strided views (slices of a fused qkv projection) as long as ``head_dim`` is
contiguous; the cache must be contiguous in its last two dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kv_cache.dtype import is_fp8, v_token_major, write_rows, write_v_rows


@triton.jit
def store_kv_row(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    t,
    slot,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
):
    """Token ``t``'s K/V rows into cache slot ``slot`` (>= 0)."""
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    if FP8:  # saturate: out-of-range values would not survive the conversion
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if V_TOKEN_MAJOR:
        head = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        dst = block * stride_cb + head * BLOCK_SIZE + off
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache: block
    stride_co,  # cache: offset in block
    stride_ch,  # cache: kv head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        store_kv_row(
            k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, t, slot, stride_kt, stride_kh, stride_vt,
            stride_vh, stride_cb, stride_co, stride_ch, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
            BLOCK_H, BLOCK_D, FP8, V_TOKEN_MAJOR,
        )  # fmt: skip


def cache_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> tuple[list, dict]:
    """The strides and constexprs :func:`store_kv_row` takes for these tensors."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    assert v.shape == k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    k_cache = kv_cache[0]
    assert k_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    strides = [k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3]]
    consts = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8(kv_cache.dtype),
        V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
    )
    return strides, consts


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32); -1 = skip
    pdl_cfg: PdlConfig = pdl.DEFAULT,
) -> None:
    """Write ``k``/``v`` into ``kv_cache`` at ``slot_mapping`` (in place; slots < 0 skipped)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert slot_mapping.shape[0] >= num_tokens
    strides, consts = cache_args(k, v, kv_cache)
    m = pdl.mode(k, num_tokens, pdl_cfg)
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        *strides,
        **consts,
        PDL=m,
        **pdl.launch_options(m),
    )


def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain torch version of :func:`reshape_and_cache`."""
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, nb * bs, kv_cache.shape[3], kv_cache.shape[4])
    keep = slot_mapping[: k.shape[0]] >= 0
    slots = slot_mapping[: k.shape[0]][keep].long()
    write_rows(flat[0], slots, k[keep])
    write_v_rows(kv_cache, slots, v[keep])
