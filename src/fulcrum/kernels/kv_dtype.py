"""Triton side of the KV-cache element types (see ``fulcrum.kv_cache.dtype``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fulcrum.kv_cache.dtype import is_fp8, v_token_major

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def compute_dtype(q: torch.Tensor, kv_cache: torch.Tensor):
    """The Triton dtype attention math runs in: the cache's, or the query's for an FP8 cache."""
    return _TL[q.dtype if is_fp8(kv_cache.dtype) else kv_cache.dtype]


def dot_precision(q: torch.Tensor, kv_cache: torch.Tensor) -> str:
    """``tl.dot`` precision: exact for fp32 math (tests on the CPU), tensor cores otherwise."""
    return "ieee" if compute_dtype(q, kv_cache) == tl.float32 else "tf32"


def tile_tokens(block_n: int, kv_cache: torch.Tensor) -> int:
    """Tokens per K/V tile of the attention kernels: a token-major V tile covers whole pages."""
    page = kv_cache.shape[2]
    return max(block_n, page) if v_token_major(kv_cache.dtype) else block_n


@triton.jit
def load_v_token_major(
    v_cache_ptr,
    bt_row,  # the request's block-table row
    n0,  # first token of the tile (a multiple of PAGE_SIZE)
    end,  # tokens from `end` on get weight 0
    kvh,
    stride_cb,
    offs_d,
    mask_d,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """V tile ``[BLOCK_N, BLOCK_D]`` from token-major blocks ``[kv_head, d, page]``, loaded as
    pages x tokens x d so each page's tokens are contiguous. Whole pages are read: tokens past
    ``end`` must get weight 0 from the caller, and are finite (the pool starts zeroed and every
    write saturates)."""
    pg = n0 // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
    pg_ok = pg * PAGE_SIZE < end
    blk = tl.load(bt_row + pg, mask=pg_ok, other=0).to(tl.int64)
    base = blk * stride_cb + kvh * (HEAD_DIM * PAGE_SIZE)
    offs_o = tl.arange(0, PAGE_SIZE)
    off = base[:, None, None] + offs_o[None, :, None] + offs_d[None, None, :] * PAGE_SIZE
    v = tl.load(v_cache_ptr + off, mask=pg_ok[:, None, None] & mask_d[None, None, :], other=0.0)
    return tl.reshape(v, (BLOCK_N, BLOCK_D))
