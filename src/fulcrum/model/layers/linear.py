"""``nn.Linear`` whose few-row calls on CUDA run the Triton GEMV (``kernels/gemv.py``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.config import KernelConfig
from fulcrum.kernels import GEMV_MAX_M
from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.model.layers.activation import silu_and_mul
from fulcrum.model.layers.norm import RMSNorm
from fulcrum.model.layers.packed_cpu import PackedRows, packed_linear


class Linear(Configured, nn.Linear):
    """A decode step of up to ``kernel_config.gemv.max_m`` requests runs the GEMV, measured
    faster than cuBLAS on every linear layer of an 8B model at batch 1; anything larger runs
    the BLAS GEMM. On the CPU the row counts of ``packed_rows`` take the weight's oneDNN-packed
    copy where it has one (``packed_cpu.py``; ``weight`` is None where that copy serves every
    row count)."""

    packed: torch.Tensor | None = None
    packed_rows: PackedRows = PackedRows()

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias, per-row scale) as the GEMV takes them (``norm_linear``)."""
        return self.weight, self.bias, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the row count first: a prefill step pays one comparison per layer, not the dispatch
        if x.shape[0] <= GEMV_MAX_M and x.dim() == 2:
            kc = self.kernel_config
            if use_triton(x, kc):
                from fulcrum.kernels import gemv

                g = kc.gemv
                if gemv.use_gemv(x, self.weight, g.max_m):
                    return gemv.gemv(x, self.weight, self.bias, pdl_cfg=kc.pdl, launch=g.launch)
        if self.packed is not None and self.packed_rows.serves(x):
            y = packed_linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])  # views where x is 2-D
        return F.linear(x, self.weight, self.bias)


def _norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = x`` or ``x + residual``."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def _one_row_operands(layer: nn.Module, x: torch.Tensor, kc: KernelConfig):
    """The layer's GEMV operands where ``x`` is one row on CUDA and the GEMV takes it."""
    operands = getattr(layer, "gemv_operands", None)
    if operands is None or x.shape[0] != 1 or x.dim() != 2 or not use_triton(x, kc):
        return None
    from fulcrum.kernels import gemv

    weight, bias, scale = operands()
    return (weight, bias, scale) if gemv.use_gemv(x, weight, kc.gemv.max_m) else None


def _fp8_rows(layer: nn.Module, x: torch.Tensor, kc: KernelConfig) -> bool:
    """Whether ``layer`` takes ``x``'s rows quantized by the kernel before it (an FP8 layer on
    its GEMM path, ``kc.fuse_fp8_quant``)."""
    takes = getattr(layer, "takes_fp8_rows", None)
    return kc.fuse_fp8_quant and takes is not None and takes(x)


def _int_one_row(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``layer`` is a packed integer layer whose one-row kernel takes ``x`` with an
    epilogue (``quant/int4.py``: ``takes_one_row`` / ``one_row_epilogue``)."""
    takes = getattr(layer, "takes_one_row", None)
    return takes is not None and takes(x)


def silu_linear(y: torch.Tensor, layer: nn.Module, kc: KernelConfig) -> torch.Tensor:
    """``layer(silu_and_mul(y))``; an FP8 layer's GEMM takes the activation already quantized
    (one kernel for both, ``kc.fuse_fp8_quant``)."""
    if _fp8_rows(layer, y, kc):
        from fulcrum.kernels.activation import silu_and_mul_quant_fp8

        q, s = silu_and_mul_quant_fp8(y, kc.pdl)
        return layer.forward_fp8(q, s, y.dtype)
    return layer(silu_and_mul(y, kc))


def norm_linear(
    norm: RMSNorm,
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    kc: KernelConfig,
    silu: bool = False,
    then: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer(norm(h)), h)`` with ``h = x`` or ``x + residual``; with ``silu``,
    ``silu_and_mul`` of the projection (gate_up), in the projection's own kernel where it runs
    the one-row GEMV on CUDA (``gemv.silu_gemv``, when ``kc.gemv.fuse_silu``): the activation's
    launch, and its trip through memory, drop out; with ``then`` (the down projection) that
    activation goes through ``then`` (``silu_linear``). An FP8 layer's GEMM takes its input
    rows quantized by the kernel before it (``kc.fuse_fp8_quant``)."""
    if _fp8_rows(layer, x, kc) and type(norm) is RMSNorm:  # the kernel computes this norm
        from fulcrum.kernels.rmsnorm import rms_norm_quant_fp8

        first = kc.rmsnorm_weight_first
        q, s, h = rms_norm_quant_fp8(x, residual, norm.weight, norm.eps, kc.pdl, first)
        y = layer.forward_fp8(q, s, x.dtype)
    else:
        x, h = _norm(norm, x, residual)
        fuse = silu and kc.gemv.fuse_silu
        operands = _one_row_operands(layer, x, kc) if fuse else None
        if operands is None and fuse and _int_one_row(layer, x):
            act = layer.one_row_epilogue(x, silu=True)
            return (act if then is None else then(act)), h
        if operands is not None:
            from fulcrum.kernels import gemv

            weight, bias, scale = operands
            g = kc.gemv
            act = gemv.silu_gemv(
                x, weight, bias, scale=scale, pdl_cfg=kc.pdl, launch=g.launch, fp8_words=g.fp8_words
            )
            return (act if then is None else then(act)), h
        y = layer(x)
    if not silu:
        return y, h
    return (silu_and_mul(y, kc) if then is None else silu_linear(y, then, kc)), h


class RopeKV(NamedTuple):
    """What the qkv projection needs to apply rotary and write the step's K/V itself."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor | None  # [max_position, rotary_dim] fp32
    kv_cache: torch.Tensor  # [2, num_blocks, page, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [>= T]
    num_heads: int
    num_kv_heads: int
    head_dim: int


def norm_linear_rope(
    norm: RMSNorm,
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    rope: RopeKV,
    kc: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(qkv, h)`` as :func:`norm_linear` gives them, with rotary applied to q and k and the
    K/V rows written into the cache by the projection's own one-row GEMV
    (``gemv.rope_gemv``, when ``kc.gemv.fuse_rope``; a packed integer layer's one-row kernel
    likewise): the rotary kernel's launch drops out of the decode step. None where that does
    not apply (the caller then runs the two kernels)."""
    cs = rope.cos_sin_cache
    if not kc.gemv.fuse_rope or cs is None or cs.shape[1] != rope.head_dim:
        return None
    operands = _one_row_operands(layer, x, kc)
    if operands is None:  # a packed integer layer's one-row kernel: whole power-of-two heads
        if rope.head_dim & (rope.head_dim - 1) or not _int_one_row(layer, x):
            return None
        x, h = _norm(norm, x, residual)
        return layer.one_row_epilogue(x, rope=rope), h
    from fulcrum.kernels import gemv

    weight, bias, scale = operands
    x, h = _norm(norm, x, residual)
    qkv = gemv.rope_gemv(
        x, weight, rope.positions, cs, rope.kv_cache, rope.slot_mapping, rope.num_heads,
        rope.num_kv_heads, bias=bias, scale=scale, pdl_cfg=kc.pdl, launch=kc.gemv.launch,
        fp8_words=kc.gemv.fp8_words,
    )  # fmt: skip
    return qkv, h
