"""Weight-only integer quantization from GPTQ and AWQ checkpoints (4 bits; GPTQ also 8), the
formats of vLLM's ``--quantization gptq`` / ``awq``: weights stay packed in memory.

A layer first holds its checkpoint's tensors as they are on disk (``int_format.py`` describes
both layouts); fused projections (qkv, gate_up) take each shard's columns. Once every tensor
is in, ``finish_loading`` repacks them, once, into the layout the kernels read
(``kernels/w4a16_common.py``: ``int32 [in/8, out]``, zeros as bytes, groups contiguous) and drops the
checkpoint copies. A tensor-parallel rank's act-order slice of a row-parallel layer's input rows
is regrouped into padded chunks instead (``int_regroup.py``). At run time:

- CUDA: the W4A16 GEMV up to ``kernel_config.gemv.max_m`` rows (at most ``w4a16.GEMV_ROWS``),
  the W4A16 GEMM above; an act-order layer gathers x's columns into its permuted row order first.
- CPU: the weight is dequantized for the call (fp32, exactly ``(q - zero) * scale``) and
  multiplied in the original row order, as ``F.linear`` multiplies a full-precision layer; the
  packed words stay the only copy kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels import GEMV_MAX_M, w4a16, w4a16_common, w4a16_gemv
from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.quant.base import QuantMethod, register_quant_method
from fulcrum.quant.int_format import IntWeightFormat, repack


class IntLinear(Configured, nn.Module):
    """``nn.Linear`` over a packed integer weight (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: IntWeightFormat):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.group = fmt.group_for(in_features)
        self.layer_name = "linear layer"
        self.packed = False  # True once in the kernels' layout
        self.mins: torch.Tensor | None = None  # an additive term per group (GGUF's Q4_1)
        for name, (shape, dtype) in fmt.checkpoint_shapes(in_features, out_features).items():
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # act-order: the checkpoint row each packed row came from (None: the identity)
        self.register_buffer("perm", None, persistent=False)
        self._g_idx_shards = 0
        self.all_groups = False  # an act-order row-parallel slice: every group's zeros, scales

    def shard_input(self, world: int) -> None:
        """This layer holds one of ``world`` row-parallel slices of a layer's input rows (the
        loader hands it those rows). An act-order checkpoint spreads each group's rows over
        every slice, so the layer then takes all the groups' zeros and scales, and regroups its
        rows when loading finishes (``int_regroup.py``); otherwise its slice is whole groups."""
        fmt = self.fmt
        if not fmt.desc_act or fmt.group_size == -1 or self.packed:
            return
        groups = self.in_features * world // fmt.group_size
        shapes = fmt.checkpoint_shapes(self.in_features, self.out_features, groups)
        for name in ("qzeros", "scales"):
            shape, dtype = shapes[name]
            dev = getattr(self, name).device
            t = torch.zeros(shape, dtype=dtype, device=dev)
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        self.all_groups = True

    def check_format(self, name: str) -> None:
        """Raise naming the layer if the checkpoint's format cannot describe it (before loading)."""
        self.layer_name = name
        self.fmt.check_layer(name, self.in_features, self.out_features, not self.all_groups)

    def load_packed(self, leaf: str, tensor: torch.Tensor, offset: tuple[int, int] | None) -> bool:
        """Copy checkpoint tensor ``leaf`` (output features ``offset = (start, size)`` of a
        fused projection, or all of them); False for a tensor the default loader copies."""
        if leaf not in ("qweight", "qzeros", "scales", "g_idx") or self.packed:
            return False
        p: torch.Tensor = getattr(self, leaf).data
        if leaf == "g_idx":  # one per input row, the same for every shard of a fused layer
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"{self.layer_name}: g_idx of shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(p.shape)}.")  # fmt: skip
            if self._g_idx_shards and not torch.equal(p, tensor.to(p.device, p.dtype)):
                raise ValueError(
                    f"{self.layer_name}: the fused projections' g_idx differ (act-order "
                    "permutations must match across q/k/v and gate/up)."
                )
            p.copy_(tensor)
            self._g_idx_shards += 1
            return True
        div = self.fmt.out_divisor(leaf)
        start, size = offset if offset is not None else (0, self.out_features)
        if start % div or size % div:
            raise ValueError(f"{self.layer_name}: shard at output {start} of {size} features "
                             f"is not a multiple of the {div} packed in a word ({leaf}).")  # fmt: skip
        dst = p.narrow(1, start // div, size // div)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{self.layer_name}.{leaf}: checkpoint tensor of shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)} ({self.fmt.method}, bits {self.fmt.bits}, "
                f"group_size {self.fmt.group_size})."
            )
        dst.copy_(tensor)
        return True

    def finish_loading(self) -> None:
        """Repack the checkpoint tensors into the kernels' layout (once)."""
        if self.packed:
            return
        names = list(self.fmt.checkpoint_shapes(self.in_features, self.out_features))
        tensors = {n: getattr(self, n).data for n in names}
        qweight, zeros, scales, perm, self.group = repack(
            self.fmt, tensors, self.in_features, self.layer_name
        )
        for n in names:
            delattr(self, n)
        self._set_packed(qweight, zeros, scales, perm)

    def _set_packed(self, qweight, zeros, scales, perm) -> None:
        self.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        self.zeros = nn.Parameter(zeros.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        self.perm = perm
        self.packed = True

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random packed words, zero points mid-range and scales keeping weights in
        [-0.02, 0.02]: the kernels' layout directly, nothing in full precision."""
        dev = self.qweight.device
        bits, k, n = self.fmt.bits, self.in_features, self.out_features
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // self.fmt.pack, n), dtype=torch.int32,
                                generator=generator, device=dev)  # fmt: skip
        groups = k // self.group
        zeros = torch.full((groups, n), 1 << (bits - 1), dtype=torch.uint8, device=dev)
        scales = torch.full((groups, n), 0.02 / (1 << (bits - 1)), dtype=torch.float16, device=dev)
        for name in [p for p in self._parameters if p != "bias"]:
            delattr(self, name)
        self.mins = None
        self._set_packed(qweight, zeros, scales, None)
        if self.bias is not None:
            self.bias.data.uniform_(-0.02, 0.02, generator=generator)

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` fp32 in the checkpoint's row order (tests, the CPU path)."""
        w = w4a16_common.dequantize_t(
            self.qweight, self.zeros, self.scales, self.group, self.fmt.bits, self.mins
        )
        if self.perm is not None:  # padding rows of a regrouped slice add their zero weight
            out = w.new_zeros(w.shape[0], self.in_features)
            w = out.index_add_(1, self.perm.to(w.device), w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            raise RuntimeError(f"{self.layer_name}: called before finish_loading()")
        x2 = x.reshape(-1, self.in_features)
        kc = self.kernel_config
        if not use_triton(x2, kc):
            y = F.linear(x2, self.dequantized_weight().to(x.dtype), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        few = x2.shape[0] <= min(kc.gemv.max_m, GEMV_MAX_M)
        y = w4a16.linear(
            x2, self.qweight, self.zeros, self.scales, self.bias, self.group, self.fmt.bits,
            mins=self.mins, few=few, one_row=kc.gemv.int_one_row,
            swap_ab=kc.int_gemm.swap_ab, dense_rows=kc.int_gemm.dense_rows, pdl_cfg=kc.pdl,
        )  # fmt: skip
        return y.view(*x.shape[:-1], self.out_features)

    # The one-row kernel's epilogues (``model/layers/linear.py``: ``norm_linear`` and
    # ``norm_linear_rope`` look for these two hooks): SiLU-and-mul in gate_up's projection,
    # rotary and the K/V write in qkv's, as the bf16 and FP8 layers' GEMV runs them.
    def takes_one_row(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is one row that this layer's one-row kernel (and its epilogues) takes."""
        kc = self.kernel_config
        return (
            self.packed
            and kc.gemv.int_one_row
            and kc.gemv.max_m >= 1
            and use_triton(x, kc)
            and w4a16_gemv.one_row_fits(x, self.in_features, self.group, self.fmt.bits)
        )

    def one_row_epilogue(self, x: torch.Tensor, silu: bool = False, rope=None) -> torch.Tensor:
        """This layer on one row (``takes_one_row``) with SiLU-and-mul applied to its gate and
        up halves (``silu``) or rotary and the K/V write of ``rope`` (a ``RopeKV``: the
        projection is qkv's) in the kernel's epilogue."""
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        ops = (x, self.qweight, self.zeros, self.scales, self.bias, self.group, self.fmt.bits)
        pdl_cfg = self.kernel_config.pdl
        if silu:
            return w4a16_gemv.silu_gemv1(*ops, mins=self.mins, pdl_cfg=pdl_cfg)
        return w4a16_gemv.rope_gemv1(
            *ops, self.mins, rope.positions, rope.cos_sin_cache, rope.kv_cache,
            rope.slot_mapping, rope.num_heads, rope.num_kv_heads, pdl_cfg=pdl_cfg,
        )  # fmt: skip

    def extra_repr(self) -> str:
        f = self.fmt
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{f.method} int{f.bits} group {self.group}")  # fmt: skip


class _IntMethod(QuantMethod):
    def __init__(self, quant_config: dict[str, Any] | None = None) -> None:
        self.format = IntWeightFormat.from_config(self.name, quant_config)

    @classmethod
    def from_quant_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:
        return cls(quant_config)

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return IntLinear(in_features, out_features, bias, self.format)

    def check_device(self, device: torch.device) -> None:
        """Any CUDA GPU Triton compiles for, and the CPU (the torch path)."""


@register_quant_method("gptq")
class GptqMethod(_IntMethod):
    pass


@register_quant_method("awq")
class AwqMethod(_IntMethod):
    pass
