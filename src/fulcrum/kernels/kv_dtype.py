"""Triton side of the KV-cache element types (see ``fulcrum.kv_cache.dtype``)."""

from __future__ import annotations

import torch
import triton.language as tl

from fulcrum.kv_cache.dtype import is_fp8

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def compute_dtype(q: torch.Tensor, kv_cache: torch.Tensor):
    """The Triton dtype attention math runs in: the cache's, or the query's for an FP8 cache."""
    return _TL[q.dtype if is_fp8(kv_cache.dtype) else kv_cache.dtype]


def dot_precision(q: torch.Tensor, kv_cache: torch.Tensor) -> str:
    """``tl.dot`` precision: exact for fp32 math (tests on the CPU), tensor cores otherwise."""
    return "ieee" if compute_dtype(q, kv_cache) == tl.float32 else "tf32"
