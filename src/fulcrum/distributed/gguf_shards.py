"""GGUF files over tensor-parallel ranks (``quantization="gguf"``): the part of each projection's
raw blocks a rank reads (a slice of the file's memory map, so only those bytes are read), and
the start-up check that every rank's slice of an input dimension falls on a block boundary.

A projection's blocks are ``uint8 [n, row bytes]``: output feature i is row i, and its inputs
run along the row in blocks of B values packed in b bytes, each block with its own scales::

    Q4_0 / Q4_1 / Q8_0     B = 32     b = 18 / 20 / 34
    Q4_K / Q5_K / Q6_K     B = 256    b = 144 / 176 / 210

    column-parallel (q, k, v, gate, up)    output features [s, s + n): rows s .. s+n
    row-parallel (o_proj, down_proj)       input features [s, s + n): bytes s/B*b .. (s+n)/B*b
                                           of every row (B must divide s and n)

A block is self-contained (its scales and its values), so a slice of whole blocks repacks into
exactly the matching slice of the whole tensor's kernel layout: columns of ``[K / .., N]`` for a
column-parallel slice, rows for a row-parallel one. Each part of a fused projection (q/k/v,
gate/up) is a GGUF tensor of its own type, sliced on its own; the layer keeps one part per type.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fulcrum.distributed.sharding import ShardSpec


def block_shape(type_name: str) -> tuple[int, int]:
    """``(values, bytes)`` of one block of GGUF type ``type_name``."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def _off_block(name: str, type_name: str, k: int, n: int, values: int, where: str) -> str:
    layer = name.removesuffix(".weight")
    return (f"{where}: {layer} ({type_name}) has {k} input features, split into {n} per rank, "
            f"not a multiple of the {values} values of a {type_name} block.")  # fmt: skip


def block_slice(
    spec: ShardSpec, name: str, type_name: str, data: np.ndarray, k: int
) -> tuple[np.ndarray, int, int]:
    """This rank's part of projection ``name``'s blocks ``data [n, row bytes]`` (``k`` inputs a
    row): the slice's blocks, output features and input features."""
    rule = spec.rule(name)
    if rule is None:
        raise ValueError(f"{name}: not a projection that tensor parallelism splits.")
    dim, (start, size) = rule
    if dim == 0:
        return data[start : start + size], size, k
    values, nbytes = block_shape(type_name)
    if start % values or size % values:
        raise ValueError(_off_block(name, type_name, k, size, values, f"rank {spec.rank}"))
    return data[:, start // values * nbytes : (start + size) // values * nbytes], len(data), size


def check_gguf_shards(
    spec: ShardSpec, projections: Iterable[tuple[str, str, int]], where: str
) -> None:
    """Raise ``ValueError`` naming the layer, its type and the numbers where a rank's slice of a
    row-parallel projection's inputs would split a block; ``projections``: ``(name, type, k)``
    of every projection weight in the file."""
    for name, type_name, k in projections:
        rule = spec.rule(name)
        if rule is None or rule[0] == 0:  # output rows: any split keeps whole blocks
            continue
        size = rule[1][1]  # every rank's slice starts at a multiple of it
        values = block_shape(type_name)[0]
        if size % values:
            raise ValueError(_off_block(name, type_name, k, size, values, where))
