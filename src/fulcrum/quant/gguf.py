"""GGUF weights kept packed (``quantization="gguf"``): each projection's blocks are repacked
once at load into the layout of the W4A16 kernels (``kernels/w4a16.py``) instead of being
dequantized to full precision.

llama.cpp's blocks map onto ``w = (q - zero) * scale (+ min)`` per group of 32 input rows::

    Q4_0  d fp16, 16 bytes: values j and j + 16 in the low and high nibble of byte j
          w = (q - 8) * d                  -> 4 bits, zero 8, scale d
    Q4_1  d, m fp16, the same nibbles      -> 4 bits, zero 0, scale d, min m
          w = q * d + m
    Q8_0  d fp16, 32 int8                  -> 8 bits, q + 128, zero 128, scale d
          w = q * d

The products are those of ``gguf``'s own dequantizer, in the same order, so the packed layer's
weights equal its output exactly. The K-quants (Q4_K, Q5_K, Q6_K) are not repacked: a file
holding them in a projection loads with the default (dequantized) path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fulcrum.kernels.w4a16 import pack_rows
from fulcrum.quant.base import QuantMethod, register_quant_method
from fulcrum.quant.int4 import IntLinear
from fulcrum.quant.int_format import IntWeightFormat

BLOCK = 32
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
LEAVES = ("qweight", "zeros", "scales", "mins")


def repack_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """One tensor's raw blocks (``uint8 [n, bytes per row]``, ``n`` output rows of ``k``) ->
    ``qweight [k / P, n]``, ``zeros``, ``scales``, ``mins`` ``[k / 32, n]``."""
    if type_name not in PACKED_TYPES:
        raise ValueError(f"type {type_name}; packed GGUF supports {', '.join(PACKED_TYPES)}")
    g = k // BLOCK
    raw = torch.from_numpy(np.array(data, copy=True).reshape(n, g, -1))  # the file is read-only
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [n, g]
    mins = torch.zeros_like(d)
    if type_name == "Q8_0":
        q = raw[..., 2:34].contiguous().view(torch.int8).to(torch.int32) + 128
        bits, zero = 8, 128
    else:
        off = 4 if type_name == "Q4_1" else 2
        if type_name == "Q4_1":
            mins = raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
        qs = raw[..., off : off + 16].to(torch.int32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # values 0..15, then 16..31 of each block
        bits, zero = 4, 0 if type_name == "Q4_1" else 8
    q = q.reshape(n, k)
    return {
        "qweight": pack_rows(q.t().contiguous(), bits),
        "zeros": torch.full((g, n), zero, dtype=torch.uint8),
        "scales": d.t().contiguous(),
        "mins": mins.t().contiguous(),
    }


class GgufLinear(IntLinear):
    """A projection over repacked GGUF blocks. Its tensors arrive already in the kernels'
    layout, one shard per fused projection; their bit width (4 for Q4_0/Q4_1, 8 for Q8_0)
    is the file's, so the first shard sizes them."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.fmt = IntWeightFormat("gguf", bits=4, group_size=BLOCK, sym=False)
        self.group = BLOCK
        self.layer_name = "linear layer"
        self.packed = False
        g = max(1, in_features // BLOCK)
        self.qweight = nn.Parameter(
            torch.zeros(in_features // 8, out_features, dtype=torch.int32), requires_grad=False
        )
        self.zeros = nn.Parameter(torch.zeros(g, out_features, dtype=torch.uint8), False)
        self.scales = nn.Parameter(torch.zeros(g, out_features, dtype=torch.float16), False)
        self.mins = nn.Parameter(torch.zeros(g, out_features, dtype=torch.float16), False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_buffer("perm", None, persistent=False)
        self._rows: dict[str, int] = {}

    def check_format(self, name: str) -> None:
        self.layer_name = name
        if self.in_features % BLOCK:
            raise ValueError(f"{name}: GGUF blocks of {BLOCK} do not divide the layer's "
                             f"{self.in_features} input features.")  # fmt: skip

    def load_packed(self, leaf: str, tensor: torch.Tensor, offset: tuple[int, int] | None) -> bool:
        if leaf not in LEAVES or self.packed:
            return False
        p: nn.Parameter = getattr(self, leaf)
        rows = self._rows.setdefault(leaf, tensor.shape[0])
        if rows != tensor.shape[0]:
            raise ValueError(f"{self.layer_name}: the fused projections' GGUF types differ "
                             f"({leaf} of {tensor.shape[0]} rows, then {rows}).")  # fmt: skip
        if tuple(p.shape) != (rows, self.out_features) or p.dtype != tensor.dtype:  # 8 bits
            p.data = torch.zeros(rows, self.out_features, dtype=tensor.dtype, device=p.device)
        start, size = offset if offset is not None else (0, self.out_features)
        dst = p.data.narrow(1, start, size)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{self.layer_name}.{leaf}: GGUF tensor of shape "
                             f"{tuple(tensor.shape)}, expected {tuple(dst.shape)}.")  # fmt: skip
        dst.copy_(tensor)
        return True

    def finish_loading(self) -> None:
        if self.packed:
            return
        bits = 32 * self.qweight.shape[0] // self.in_features
        self.fmt = IntWeightFormat("gguf", bits=bits, group_size=BLOCK, sym=False)
        if not bool(self.mins.any()):  # Q4_0 and Q8_0 have none: no bytes, no add
            self.mins = None
        self.packed = True

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"gguf int{self.fmt.bits} blocks of {BLOCK}")  # fmt: skip


@register_quant_method("gguf")
class GgufMethod(QuantMethod):
    @classmethod
    def from_quant_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:
        return cls()

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return GgufLinear(in_features, out_features, bias)

    def check_device(self, device: torch.device) -> None:
        """Any CUDA GPU Triton compiles for, and the CPU (the torch path)."""
