"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) read from their bytes and repacked once into the
layout of ``kernels/kquant.py``. One super-block of 256 weights of an output row::

    Q4_K  144 bytes: d fp16 | dmin fp16 | 12 bytes of eight 6-bit (sc, m) | 128 bytes of q
    Q5_K  176 bytes: d | dmin | the same 12 | 32 bytes of q's fifth bits | 128 bytes of q
    Q6_K  210 bytes: 128 bytes of q's low 4 bits | 64 of its high 2 | 16 int8 sc | d fp16

The value order inside each is that of ``gguf.quants`` (and llama.cpp's ``dequantize_row_*``).
"""

from __future__ import annotations

import numpy as np
import torch

from fulcrum.kernels.kquant import SUPER, TYPES, KPacked
from fulcrum.kernels.w4a16_common import pack_rows

BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """``[B, bytes]`` -> ``[B, 2 * bytes]``: each run of ``chunk`` bytes gives ``chunk`` values
    from its low nibbles, then ``chunk`` from its high ones."""
    b = qs.reshape(qs.shape[0], -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (b & 0xF).reshape(qs.shape[0], -1)


def _bits(qh: np.ndarray, chunk: int, width: int) -> np.ndarray:
    """``[B, bytes]`` -> values of ``width`` bits: each run of ``chunk`` bytes gives ``chunk``
    values from bits 0, then ``chunk`` from bits ``width``, ..."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, -1, 1)
    b = qh.reshape(qh.shape[0], -1, 1, chunk) >> shifts
    return (b & ((1 << width) - 1)).reshape(qh.shape[0], -1)


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins: bytes 0-3 and 4-7 hold
    scales and mins 0-3 in their low 6 bits and the top 2 bits of 4-7; bytes 8-11 the low 4."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[:, 0]


def repack_k_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> KPacked:
    """One tensor's raw blocks (``uint8 [n, bytes per row]``, ``n`` output rows of ``k``) ->
    the kernels' layout (``[rows, n]`` tensors on the CPU)."""
    if type_name not in BYTES or k % SUPER:
        raise ValueError(f"type {type_name} with {k} inputs; K-quants are {', '.join(BYTES)}")
    hi, sub, _, _ = TYPES[type_name]
    b = np.asarray(data).reshape(n * (k // SUPER), BYTES[type_name])  # one super-block a row
    m = dmin = None
    if type_name == "Q6_K":
        q = _nibbles(b[:, :128], 64) | (_bits(b[:, 128:192], 32, 2) << 4)
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
        d = _f16(b[:, 208:210])
    else:
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _scale_min(b[:, 4:16])
        if type_name == "Q4_K":
            q = _nibbles(b[:, 16:144], 32)
        else:
            q = _nibbles(b[:, 48:176], 32) | (_bits(b[:, 16:48], 32, 1) << 4)

    def cols(a: np.ndarray, rows_per_n: int) -> torch.Tensor:  # [n * ..] -> [rows, n]
        return torch.from_numpy(np.ascontiguousarray(a.reshape(n, rows_per_n).T))

    qt = torch.from_numpy(q.reshape(n, k).T.astype(np.int32))  # [k, n]
    return KPacked(
        type_name,
        pack_rows(qt & 0xF, 4),
        pack_rows(qt >> 4, hi) if hi else None,
        cols(sc, k // sub),
        None if m is None else cols(m, k // 32),
        cols(d, k // SUPER),
        None if dmin is None else cols(dmin, k // SUPER),
    )
