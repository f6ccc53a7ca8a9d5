"""An act-order slice of a layer's input rows, regrouped into the kernels' layout.

A GPTQ act-order (``desc_act``) checkpoint gives input row k to group ``g_idx[k]`` in no
particular order. A whole layer has exactly ``group_size`` rows in each group, which
``int_format.repack`` makes contiguous by permuting the rows. A row-parallel rank holds only the
rows of its slice, so each group has anywhere from 0 to ``group_size`` of them, while the kernels
read groups of one fixed size. The slice's rows are therefore sorted by group and each group's
run is padded to a multiple of a chunk of C rows; every chunk takes its group's zero and scale
row, and a padding row holds the zero point itself, so its weight is exactly 0 whatever x
column it reads::

    g_idx (the slice's rows)   3 0 3 1 0 3        counts: g0 2, g1 1, g2 0, g3 3
    sorted, C = 2              0 0 | 1 . | 3 3 | 3 .      (. : padding, weight 0;
                                                        C = 2 for the picture)
    zero / scale rows           g0 |  g1 |  g3 |  g3

Every weight keeps its checkpoint value exactly; C is the multiple of the pack, up to the group
size, that needs the fewest bytes for padding plus chunk rows. A slice of 1/tp of the rows holds
about group_size/tp of each group, so C is usually the largest such count rounded up to the pack,
one chunk a group: Llama-3.1-8B's down_proj at tp=2 (group 128, rows in random act order)
comes to about 20 % over an even split of its bytes (a kernel reading g_idx per row would
need no padding).
"""

from __future__ import annotations

import torch


def _chunk_bytes(counts: torch.Tensor, chunk: int, bits: int, row_bytes: int) -> int:
    chunks = int(((counts + chunk - 1) // chunk).sum())
    return chunks * chunk * bits // 8 + chunks * row_bytes


def best_chunk(counts: torch.Tensor, group_size: int, bits: int, scale_bytes: int) -> int:
    """The chunk (rows per zero/scale row) that stores groups of ``counts`` rows in the fewest
    bytes per output column; ties go to the larger chunk (fewer rows to index)."""
    pack = 32 // bits
    sizes = list(range(group_size - group_size % pack, 0, -pack)) or [pack]
    costs = [_chunk_bytes(counts, c, bits, scale_bytes + 1) for c in sizes]
    return sizes[costs.index(min(costs))]


def regroup(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group_size: int,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``q [n, out]`` unpacked values of the slice's rows, ``zeros``/``scales [groups, out]``
    of every group, ``g_idx [n]`` -> ``(q [P, out], zeros [P / C, out], scales [P / C, out],
    perm [P], C)``: packed row i reads x column ``perm[i]``."""
    groups, n, dev = scales.shape[0], q.shape[0], q.device
    if n and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"{name}: g_idx names groups outside 0..{groups - 1}.")
    if int(zeros.max()) >= 1 << bits:  # a padding row could not hold its zero point
        raise ValueError(
            f"{name}: a zero point of {int(zeros.max())} does not fit {bits} bits; this act-order "
            "checkpoint cannot be split over tensor-parallel ranks."
        )
    counts = torch.bincount(g_idx, minlength=groups)
    chunk = best_chunk(counts, group_size, bits, scales.element_size())
    chunks = (counts + chunk - 1) // chunk  # per group
    order = torch.argsort(g_idx, stable=True)
    by_group = g_idx[order]
    first_row = torch.cumsum(counts, 0) - counts  # each group's first row among the sorted
    first_slot = (torch.cumsum(chunks, 0) - chunks) * chunk  # and in the padded layout
    slot = first_slot[by_group] + torch.arange(n, device=dev) - first_row[by_group]
    chunk_group = torch.repeat_interleave(torch.arange(groups, device=dev), chunks)
    zeros, scales = zeros[chunk_group], scales[chunk_group]
    padded = zeros.repeat_interleave(chunk, 0).to(q.dtype)  # every slot starts at weight 0
    padded[slot] = q[order]
    perm = torch.zeros(padded.shape[0], dtype=torch.long, device=dev)
    perm[slot] = order
    return padded, zeros, scales, perm, chunk
