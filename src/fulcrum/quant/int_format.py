"""The on-disk layouts of GPTQ and AWQ checkpoints, and their repacking into the kernels' layout.

Both store, per linear layer ``W [out, in]`` quantized per group of ``group_size`` input
channels, ``w = (q - zero) * scale``::

    GPTQ (AutoGPTQ / GPTQModel)           AWQ (AutoAWQ, GEMM version)
    qweight int32 [in / P, out]           qweight int32 [in, out / 8]
      P = 32 / bits values along `in`,      8 values along `out`, column 8i + ORDER[j] in
      row k at bits (k % P) * bits          nibble j (ORDER = 0 2 4 6 1 3 5 7)
    qzeros  int32 [groups, out / P]       qzeros  int32 [groups, out / 8], same order
      zero - 1 in the v1 format (the        zero as is
      nibble read back plus one)
    scales  fp16  [groups, out]           scales  fp16  [groups, out]
    g_idx   int32 [in]: group of row k    (groups are consecutive rows)
      (act-order: not monotone)

The kernels' layout (``kernels/w4a16_common.py``) is GPTQ's qweight with groups made contiguous
(act-order rows permuted, ``perm``), zeros unpacked to bytes and scales as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fulcrum.kernels.w4a16_common import pack_rows, unpack_rows
from fulcrum.quant.int_regroup import regroup

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column ORDER[j] of its 8
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a word sits in nibble REVERSE[c]


@dataclass(frozen=True)
class IntWeightFormat:
    """What ``config.json``'s ``quantization_config`` says about the checkpoint's layout."""

    method: str  # "gptq" | "awq"
    bits: int = 4
    group_size: int = 128  # -1: one group over the whole input
    sym: bool = True
    desc_act: bool = False
    zeros_minus_one: bool = True  # GPTQ's v1 format (AutoGPTQ); v2 stores zeros as they are

    @classmethod
    def from_config(cls, method: str, qc: dict[str, Any] | None) -> IntWeightFormat:
        """The format from a ``quantization_config`` (None: 4 bits, group 128, symmetric --
        what dummy weights use). Unsupported values raise ``ValueError`` naming the field."""
        if qc is None:
            return cls(method, zeros_minus_one=method == "gptq")
        where = "quantization_config"
        bits = qc.get("bits", qc.get("w_bit", 4))
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or (group < 1 and group != -1):
            raise ValueError(f"{where}.group_size: expected a positive size or -1, got {group!r}.")
        if method == "gptq":
            if bits not in (4, 8):
                raise ValueError(f"{where}.bits: gptq supports 4 and 8 bits, got {bits!r}.")
            fmt = str(qc.get("checkpoint_format", "gptq"))
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(
                    f"{where}.checkpoint_format: expected gptq or gptq_v2, got {fmt!r} "
                    "(exllama/marlin-only layouts are not read)."
                )
            return cls(
                method, bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                zeros_minus_one=fmt == "gptq",
            )  # fmt: skip
        if method == "awq":
            if bits != 4:
                raise ValueError(f"{where}.bits: awq supports 4 bits, got {bits!r}.")
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}.version: awq supports the gemm layout, got {version!r}.")
            if not qc.get("zero_point", True):
                raise ValueError(f"{where}.zero_point: awq without zero points is not supported.")
            return cls(method, 4, group, sym=False, zeros_minus_one=False)
        raise ValueError(f"{where}.quant_method: expected gptq or awq, got {method!r}.")

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def check_layer(
        self, name: str, in_features: int, out_features: int, whole_groups: bool = True
    ) -> None:
        """Raise ``ValueError`` naming ``name`` and the field if this layer cannot take it
        (``whole_groups`` False: an act-order slice of a layer's input rows, any number of each
        group's)."""
        group = self.group_for(in_features)
        if whole_groups and in_features % group:
            raise ValueError(
                f"{name}: quantization_config.group_size {group} does not divide the layer's "
                f"{in_features} input features."
            )
        if in_features % self.pack or out_features % self.pack:
            raise ValueError(
                f"{name}: quantization_config.bits {self.bits} packs {self.pack} values per word; "
                f"the layer's shape [{out_features}, {in_features}] is not a multiple of that."
            )

    def checkpoint_shapes(
        self, in_features: int, out_features: int, groups: int | None = None
    ) -> dict[str, tuple]:
        """The checkpoint tensors of one layer and their shapes (output dimension last);
        ``groups``: rows of zeros and scales where they are not the layer's own (an act-order
        row-parallel slice holds every group's)."""
        groups = groups or max(1, in_features // self.group_for(in_features))
        p = self.pack
        if self.method == "gptq":
            return {
                "qweight": ((in_features // p, out_features), torch.int32),
                "qzeros": ((groups, out_features // p), torch.int32),
                "scales": ((groups, out_features), torch.float16),
                "g_idx": ((in_features,), torch.int32),
            }
        return {
            "qweight": ((in_features, out_features // 8), torch.int32),
            "qzeros": ((groups, out_features // 8), torch.int32),
            "scales": ((groups, out_features), torch.float16),
        }

    def out_divisor(self, name: str) -> int:
        """How many output features one column of tensor ``name`` covers (packed along out)."""
        if name == "qzeros" or (name == "qweight" and self.method == "awq"):
            return self.pack
        return 1


def unpack_awq(t: torch.Tensor) -> torch.Tensor:
    """``int32 [R, C / 8]`` in AWQ's interleaved order -> ``int32 [R, C]`` values."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=t.device)
    nib = (t[:, :, None] >> shifts) & 0xF  # [R, C/8, 8]: nibble j
    rev = torch.tensor(AWQ_REVERSE, device=t.device)
    return nib[:, :, rev].reshape(t.shape[0], -1)


def unpack_cols(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``int32 [R, C / P]`` packed along columns in order -> ``int32 [R, C]``."""
    return unpack_rows(t.t().contiguous(), bits).t()


def repack(
    fmt: IntWeightFormat,
    tensors: dict[str, torch.Tensor],
    in_features: int,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Checkpoint tensors -> ``(qweight [rows/P, out], zeros uint8 (int16 for v1's 256) [rows/group, out],
    scales, perm [rows] or None, group)`` in the kernels' layout: ``rows`` is ``in_features``,
    or more for an act-order slice of a layer's rows (``int_regroup.py``), whose ``group`` is
    then the chunk it was regrouped by."""
    group = fmt.group_for(in_features)
    scales = tensors["scales"]
    if fmt.method == "awq":
        q = unpack_awq(tensors["qweight"])
        zeros = unpack_awq(tensors["qzeros"])
    else:
        q = unpack_rows(tensors["qweight"], fmt.bits)
        zeros = unpack_cols(tensors["qzeros"], fmt.bits) + (1 if fmt.zeros_minus_one else 0)
    perm = None
    g_idx = tensors.get("g_idx")
    if g_idx is not None and scales.shape[0] * group != in_features:  # act-order row slice
        q, zeros, scales, perm, group = regroup(
            q, zeros, scales, g_idx.long(), fmt.bits, fmt.group_size, name
        )
    elif g_idx is not None:
        g_idx = g_idx.long()
        want = torch.arange(in_features, device=g_idx.device) // group
        if not torch.equal(g_idx, want):  # act-order: permute rows so groups are contiguous
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], want):
                raise ValueError(
                    f"{name}: g_idx does not give each group of quantization_config.group_size "
                    f"{group} exactly {group} input rows."
                )
            q = q[perm]
    # v1 reads a stored 8-bit 255 back as zero 256: the only zero that needs more than a byte
    zdtype = torch.uint8 if int(zeros.max()) < 256 else torch.int16
    return pack_rows(q, fmt.bits), zeros.to(zdtype), scales, perm, group
