"""GGUF weights kept packed (``quantization="gguf"``): each projection's blocks are repacked
once at load into a kernel's layout instead of being dequantized to full precision.

The loader hands a layer each shard's raw blocks (:class:`GgufBlocks`, one per GGUF tensor of
a fused projection). Files mix types within a layer (a Q4_K_M file keeps ``attn_v`` in Q6_K
beside Q4_K ``attn_q``/``attn_k``), so a layer holds one *part* per run of output columns of
one type, each with its own kernels; a layer of one type (most) has one part. Under tensor
parallelism a rank's shards are its slices of whole blocks (``distributed/gguf_shards.py``),
which repack into exactly the matching slices of one rank's layout.

llama.cpp's small blocks map onto ``w4a16_common.py``'s ``w = (q - zero) * scale (+ min)`` per group
of 32 input rows::

    Q4_0  d fp16, 16 bytes: values j and j + 16 in the low and high nibble of byte j
          w = (q - 8) * d                  -> 4 bits, zero 8, scale d
    Q4_1  d, m fp16, the same nibbles      -> 4 bits, zero 0, scale d, min m
          w = q * d + m
    Q8_0  d fp16, 32 int8                  -> 8 bits, q + 128, zero 128, scale d
          w = q * d

and the K-quants (Q4_K, Q5_K, Q6_K) onto ``kquant.py``'s super-blocks (``gguf_kquant.py``).
The products are those of ``gguf``'s own dequantizer, in the same order, so a packed layer's
weights equal its output exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.config import KernelConfig
from fulcrum.kernels import GEMV_MAX_M, kquant, w4a16, w4a16_common
from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.quant.base import QuantMethod, register_quant_method
from fulcrum.quant.gguf_kquant import BYTES as K_BYTES
from fulcrum.quant.gguf_kquant import repack_k_blocks

BLOCK = 32
SMALL_TYPES = ("Q4_0", "Q4_1", "Q8_0")
PACKED_TYPES = SMALL_TYPES + tuple(K_BYTES)


@dataclass
class GgufBlocks:
    """One GGUF tensor's blocks as the file holds them: ``data uint8 [n, bytes per row]``,
    ``n`` output rows of ``k`` inputs."""

    type_name: str
    data: np.ndarray
    n: int
    k: int


def repack_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """Q4_0/Q4_1/Q8_0 blocks (``uint8 [n, bytes per row]``) -> ``w4a16``'s ``qweight
    [k / P, n]``, ``zeros``, ``scales``, ``mins`` ``[k / 32, n]``."""
    if type_name not in SMALL_TYPES:
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
        "qweight": w4a16_common.pack_rows(q.t().contiguous(), bits),
        "zeros": torch.full((g, n), zero, dtype=torch.uint8),
        "scales": d.t().contiguous(),
        "mins": mins.t().contiguous(),
    }


class _SmallPart(nn.Module):
    """Columns of one Q4_0/Q4_1/Q8_0 run, for ``w4a16``'s kernels."""

    def __init__(self, blocks: GgufBlocks) -> None:
        super().__init__()
        t = repack_blocks(blocks.data, blocks.type_name, blocks.n, blocks.k)
        self.type_name = blocks.type_name
        self.bits = 8 if blocks.type_name == "Q8_0" else 4
        for name in ("qweight", "zeros", "scales"):
            setattr(self, name, nn.Parameter(t[name], requires_grad=False))
        has_min = blocks.type_name == "Q4_1"  # Q4_0 and Q8_0 have none: no bytes, no add
        self.mins = nn.Parameter(t["mins"], requires_grad=False) if has_min else None

    def dequantized(self) -> torch.Tensor:
        return w4a16_common.dequantize_t(
            self.qweight, self.zeros, self.scales, BLOCK, self.bits, self.mins
        )

    def run(
        self, x: torch.Tensor, bias: torch.Tensor | None, few: bool, kc: KernelConfig
    ) -> torch.Tensor:
        g = kc.int_gemm
        return w4a16.linear(x, self.qweight, self.zeros, self.scales, bias, BLOCK, self.bits,
                            self.mins, few=few, one_row=kc.gemv.int_one_row,
                            swap_ab=g.swap_ab, dense_rows=g.dense_rows,
                            pdl_cfg=kc.pdl)  # fmt: skip


class _KPart(nn.Module):
    """Columns of one Q4_K/Q5_K/Q6_K run, for ``kquant``'s kernels."""

    def __init__(self, blocks: GgufBlocks) -> None:
        super().__init__()
        w = repack_k_blocks(blocks.data, blocks.type_name, blocks.n, blocks.k)
        self.type_name = blocks.type_name
        self._names = [f for f, t in zip(w._fields[1:], w[1:], strict=True) if t is not None]
        for f in self._names:
            setattr(self, f, nn.Parameter(getattr(w, f), requires_grad=False))

    def packed(self) -> kquant.KPacked:
        return kquant.KPacked(
            self.type_name, *(getattr(self, f, None) for f in kquant.KPacked._fields[1:])
        )

    def dequantized(self) -> torch.Tensor:
        return kquant.dequantize(self.packed()).t()

    def run(
        self, x: torch.Tensor, bias: torch.Tensor | None, few: bool, kc: KernelConfig
    ) -> torch.Tensor:  # kc: the legacy parts' switches; K-quants have one GEMV and one GEMM
        return (kquant.gemv if few else kquant.gemm)(x, self.packed(), bias)


class GgufLinear(Configured, nn.Module):
    """``nn.Linear`` over a GGUF file's blocks, one part per run of output columns of one
    type. Before ``finish_loading`` it holds only the shards' raw blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layer_name = "linear layer"
        # the name the loader's shards arrive under: one per GGUF tensor
        self.blocks = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.parts = nn.ModuleList()
        self.packed = False
        self._shards: dict[int, GgufBlocks] = {}

    def check_format(self, name: str) -> None:
        self.layer_name = name
        if self.in_features % BLOCK:
            raise ValueError(f"{name}: GGUF blocks of {BLOCK} do not divide the layer's "
                             f"{self.in_features} input features.")  # fmt: skip

    def load_packed(self, leaf: str, blocks: Any, offset: tuple[int, int] | None) -> bool:
        if leaf != "blocks" or self.packed:
            return False
        start, size = offset if offset is not None else (0, self.out_features)
        if not isinstance(blocks, GgufBlocks) or (blocks.n, blocks.k) != (size, self.in_features):
            shape = (blocks.n, blocks.k) if isinstance(blocks, GgufBlocks) else type(blocks)
            raise ValueError(f"{self.layer_name}: GGUF tensor of shape {shape}, expected "
                             f"{(size, self.in_features)}.")  # fmt: skip
        self._shards[start] = blocks
        return True

    def finish_loading(self) -> None:
        """Merge adjacent shards of one type and repack each run, once."""
        if self.packed:
            return
        runs: list[list[GgufBlocks]] = []
        end = 0
        for start in sorted(self._shards):
            s = self._shards[start]
            if start != end:
                raise ValueError(f"{self.layer_name}: GGUF shards leave output features "
                                 f"{end}..{start} empty.")  # fmt: skip
            if runs and runs[-1][0].type_name == s.type_name:
                runs[-1].append(s)
            else:
                runs.append([s])
            end = start + s.n
        if end != self.out_features:
            raise ValueError(f"{self.layer_name}: GGUF shards fill {end} of {self.out_features} "
                             "output features.")  # fmt: skip
        dev = self.blocks.device
        for run in runs:
            t = run[0].type_name
            data = np.concatenate([np.asarray(s.data) for s in run])  # rows are independent
            merged = GgufBlocks(t, data, sum(s.n for s in run), self.in_features)
            self.parts.append((_KPart if t in K_BYTES else _SmallPart)(merged).to(dev))
        del self.blocks
        self._shards.clear()
        self.packed = True

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` fp32 (tests, the CPU path)."""
        if len(self.parts) == 1:  # no copy: the CPU path builds this on every call
            return self.parts[0].dequantized()
        return torch.cat([p.dequantized() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            raise RuntimeError(f"{self.layer_name}: called before finish_loading()")
        x2 = x.reshape(-1, self.in_features)
        kc = self.kernel_config
        if not use_triton(x2, kc):
            y = F.linear(x2, self.dequantized_weight().to(x.dtype), self.bias)
        else:
            few = x2.shape[0] <= min(kc.gemv.max_m, GEMV_MAX_M)
            if len(self.parts) == 1:
                y = self.parts[0].run(x2, self.bias, few, kc)
            else:
                y = torch.cat([p.run(x2, None, few, kc) for p in self.parts], dim=-1)
                y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = "+".join(p.type_name for p in self.parts) or "unloaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf {kinds}"


@register_quant_method("gguf")
class GgufMethod(QuantMethod):
    @classmethod
    def from_quant_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:
        return cls()

    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return GgufLinear(in_features, out_features, bias)

    def check_device(self, device: torch.device) -> None:
        """Any CUDA GPU Triton compiles for, and the CPU (the torch path)."""
