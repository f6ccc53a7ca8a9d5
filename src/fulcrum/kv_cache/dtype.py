"""KV-cache element types.

``auto`` stores K/V in the model's dtype. ``fp8`` stores ``float8_e4m3fn`` with a per-tensor scale
of 1.0: half the bytes of bf16, so a decode step reads half as much KV and twice the tokens fit.
Values are clamped to the format's finite range (±448) when written and widened when read (to the
query's dtype; the CUDA decode kernel widens to fp16, which holds every e4m3 value exactly and
converts in one instruction), so attention math never runs in FP8.
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
