"""oneDNN-packed float32 linear weights on the CPU, for the row counts where they are faster.

``F.linear`` runs the BLAS (MKL) GEMM on the ``[out, in]`` weight; oneDNN's linear on a weight
packed once into its blocked layout is another kernel for the same product. Which is faster
depends on the CPU and the row count (where MKL does not take its AVX-512 paths, as on some AMD
parts, the packed copy wins at every row count; elsewhere MKL may win at one row; figures in
BENCHMARKS.md §10 and §12.1), so the choice is measured at start-up, once per process and model (``measure_packed_rows``): one-row
steps over the model's own layers (memory-bound, as decode is) and a 256-row step of one layer
(compute-bound, as prefill is). The packed copy then serves

    rows:   1 ............ 2 ........... 64 ............ more
            packed if it     always (verify   packed if it won
            won at 1 row     steps, k + 1)    at 256 rows

Where it serves every row count, the original weight is dropped (unless another module shares
it, as a tied embedding does): the weights keep their memory. Otherwise both are kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 64  # the fixed upper end of the packed range unless 256 rows measured faster
_STREAM_BYTES = 256 << 20  # one-row timing: layers up to this many bytes, past any CPU cache
_LARGE_ROWS = 256
# One measurement per process and set of layer shapes: two engines of one model (with and
# without speculation, as the lossless tests build) then run the same kernels.
_measured: dict[tuple[tuple[int, ...], ...], PackedRows] = {}


@dataclass(frozen=True)
class PackedRows:
    """Row counts ``min_rows <= rows <= max_rows`` a packed weight serves (None: no limit)."""

    min_rows: int = 2
    max_rows: int | None = PACKED_MAX_ROWS

    @property
    def every_row_count(self) -> bool:
        return self.min_rows <= 1 and self.max_rows is None

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the packed copy computes a call on ``x`` (other than 2-D: only if it serves
        every row count)."""
        if self.every_row_count:
            return True
        r = x.shape[0] if x.dim() == 2 else 0
        return self.min_rows <= r and (self.max_rows is None or r <= self.max_rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight as :func:`pack_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a float32 CPU weight ``[out, in]``; None where oneDNN is
    missing or the weight is of another dtype or device."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, NotImplementedError) as e:  # a build without this op
        logger.info("No oneDNN-packed linear weights: %s", e)
        return None


def _best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def measure_packed_rows(pairs: list[tuple[nn.Module, torch.Tensor]]) -> PackedRows:
    """Where the packed copies beat ``F.linear``: one row over the layers (in model order, up
    to ``_STREAM_BYTES`` of weights), and ``_LARGE_ROWS`` rows through the largest layer below
    the largest (the LM head excluded by that, where it is the largest)."""
    streamed, size = [], 0
    for m, p in pairs:
        streamed.append((m, p, torch.randn(1, m.weight.shape[1])))
        size += m.weight.numel() * 4
        if size >= _STREAM_BYTES:
            break

    def one_row(packed: bool) -> None:
        for m, p, x in streamed:
            packed_linear(x, p, m.bias) if packed else F.linear(x, m.weight, m.bias)

    one_row(True), one_row(False)  # first touches: oneDNN primitive creation, page faults
    wins_one = _best_of(lambda: one_row(True)) < _best_of(lambda: one_row(False))
    by_size = sorted(pairs, key=lambda mp: mp[0].weight.numel())
    m, p = by_size[-2] if len(by_size) > 1 else by_size[-1]
    x = torch.randn(_LARGE_ROWS, m.weight.shape[1])
    packed_linear(x, p, m.bias), F.linear(x, m.weight, m.bias)
    wins_large = _best_of(lambda: packed_linear(x, p, m.bias)) < _best_of(
        lambda: F.linear(x, m.weight, m.bias)
    )
    return PackedRows(1 if wins_one else 2, None if wins_large else PACKED_MAX_ROWS)


def pack_linear_weights(
    model: nn.Module, layer_cls: type[nn.Module], speculative: bool, rows: PackedRows | None = None
) -> PackedRows | None:
    """Give every ``layer_cls`` layer of ``model`` with a float32 CPU weight a packed copy (its
    ``packed`` attribute) and the row counts it serves (``packed_rows``), measured unless
    ``rows`` is given. Without speculation (no verify steps of 2-64 rows) the copies are kept
    only where they beat ``F.linear`` at one row or at many. Returns the row counts, or None
    where nothing was packed."""
    pairs = []
    for m in model.modules():
        if isinstance(m, layer_cls):
            packed = pack_weight(m.weight)
            if packed is not None:
                pairs.append((m, packed))
    if not pairs:
        return None
    if rows is None:
        shapes = tuple(tuple(m.weight.shape) for m, _ in pairs)
        if shapes not in _measured:
            _measured[shapes] = measure_packed_rows(pairs)
        rows = _measured[shapes]
    if not speculative and rows.min_rows > 1 and rows.max_rows is not None:
        return None
    shared = {
        id(p)
        for mod in model.modules()
        if not isinstance(mod, layer_cls)
        for p in mod.parameters(recurse=False)
    }
    for m, packed in pairs:
        m.packed, m.packed_rows = packed, rows
        if rows.every_row_count and id(m.weight) not in shared:
            m.weight = None  # the packed copy serves every call: no second copy in memory
    logger.info(
        "oneDNN-packed linear weights for %s rows (%d layers)", _rows_text(rows), len(pairs)
    )
    return rows


def _rows_text(rows: PackedRows) -> str:
    return f"{rows.min_rows}-{rows.max_rows if rows.max_rows is not None else 'any'}"
