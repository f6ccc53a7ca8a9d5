"""KV-cache element types, and where a V row lives in a block.

``auto`` stores K/V in the model's dtype. ``fp8`` stores ``float8_e4m3fn`` with a per-tensor scale
of 1.0: half the bytes of bf16, so a decode step reads half as much KV and twice the tokens fit.
Values are clamped to the format's finite range (±448) when written and widened when read (to the
query's dtype; the CUDA kernels widen to fp16, which holds every e4m3 value exactly and
converts in one instruction), so attention math never runs in FP8.

A cache is one tensor ``[2, num_blocks, page, num_kv_heads, head_dim]``; K always lies in that
order. An FP8 cache stores each block of V token-major instead, ``[num_kv_heads, head_dim,
page]``, so the tensor cores' P·V operand (pairs of tokens per register) loads in 32-bit words:
with head-dim-major FP8 rows every pair took two single-byte loads (there is no 8-bit
``ldmatrix.trans``)::

    K block, and V of a 16-bit cache:   [page][kv_head][d]   token t, head h, dim d at
                                                              (t * H + h) * D + d
    V block of an FP8 cache:            [kv_head][d][page]   at (h * D + d) * page + t

:func:`v_rows` gives V in the ``[num_blocks, page, num_kv_heads, head_dim]`` order either way (a
strided view), for torch code; the Triton kernels compute the addresses themselves.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "fp8")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype (saturating for FP8: out-of-range values would become NaN)."""
    if is_fp8(dtype):
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[index] = rows`` converted to ``dst``'s dtype (byte views for FP8, which has no
    ``index_copy_`` on the CPU)."""
    rows = to_cache(rows, dst.dtype)
    if is_fp8(dst.dtype):
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst.index_copy_(0, index, rows)


def v_token_major(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores each V block token-major (see the module docstring)."""
    return is_fp8(dtype)


def v_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """V as ``[num_blocks, page, num_kv_heads, head_dim]`` whatever its block layout (a view)."""
    _, nb, page, h, d = kv_cache.shape
    if not v_token_major(kv_cache.dtype):
        return kv_cache[1]
    return kv_cache[1].view(nb, h, d, page).permute(0, 3, 1, 2)


def write_v_rows(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """V rows ``[n, num_kv_heads, head_dim]`` into token slots ``block * page + offset``."""
    _, nb, page, h, d = kv_cache.shape
    if not v_token_major(kv_cache.dtype):
        return write_rows(kv_cache[1].view(nb * page, h, d), slots, rows)
    rows = to_cache(rows, kv_cache.dtype).view(torch.uint8)  # FP8 has no index_put on the CPU
    dst = kv_cache.view(torch.uint8)[1].view(nb, h, d, page).permute(0, 3, 1, 2)
    dst[slots // page, slots % page] = rows
