"""The oneDNN-packed copy of a CPU linear layer's weight (model/layers/packed_cpu.py): the same
products as ``F.linear`` for every row count, taken only for the row counts it serves, and the
original weight dropped only where the copy serves them all and no other module shares it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulcrum.config import KernelConfig
from fulcrum.model.layers.linear import Linear
from fulcrum.model.layers.packed_cpu import (
    PACKED_MAX_ROWS,
    PackedRows,
    pack_linear_weights,
    pack_weight,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)

SPEC_ROWS = PackedRows(2, PACKED_MAX_ROWS)  # verify steps only
EVERY_ROW = PackedRows(1, None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [SPEC_ROWS, EVERY_ROW])
def test_packed_linear_equals_f_linear_for_every_row_count(bias: bool, rows: PackedRows) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach()
    model = torch.nn.Sequential(layer)
    assert pack_linear_weights(model, Linear, speculative=True, rows=rows) == rows
    assert layer.packed is not None and (layer.weight is None) == rows.every_row_count
    for n in (1, 2, 5, 9, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300):
        x = torch.randn(n, 96)
        with torch.inference_mode():
            got = layer(x)
        assert layer.packed_rows.serves(x) == (rows.min_rows <= n and (rows.max_rows or n) >= n)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 96)  # a 3-D input: packed only where it serves every row count
    with torch.inference_mode():
        torch.testing.assert_close(layer(x3), F.linear(x3, weight, b), rtol=1e-5, atol=1e-5)


def test_without_speculation_packs_only_where_faster_and_keeps_shared_weights() -> None:
    emb = torch.nn.Embedding(48, 32)
    head, plain = Linear(32, 48, bias=False), Linear(32, 32, bias=False)
    head.weight = emb.weight  # tied, as an LM head to the embedding
    model = torch.nn.Sequential(emb, plain, head)
    assert pack_linear_weights(model, Linear, speculative=False, rows=SPEC_ROWS) is None
    assert head.packed is None and plain.packed is None
    assert pack_linear_weights(model, Linear, speculative=False, rows=EVERY_ROW) == EVERY_ROW
    assert plain.weight is None and head.weight is emb.weight and head.packed is not None


def test_measured_rows_are_a_valid_range() -> None:
    model = torch.nn.Sequential(Linear(64, 128, bias=False), Linear(128, 64, bias=True))
    rows = pack_linear_weights(model, Linear, speculative=True)
    assert rows is not None and rows.min_rows in (1, 2) and rows.max_rows in (None, PACKED_MAX_ROWS)


def test_only_float32_cpu_weights_are_packed() -> None:
    fp32, bf16 = Linear(32, 48, bias=False), Linear(32, 48, bias=False).to(torch.bfloat16)
    plain = torch.nn.Linear(32, 48)
    model = torch.nn.Sequential(fp32, bf16, plain)
    assert pack_linear_weights(model, Linear, speculative=True, rows=SPEC_ROWS) == SPEC_ROWS
    assert fp32.packed is not None and bf16.packed is None and not hasattr(plain, "packed")
    assert pack_weight(torch.zeros(4, dtype=torch.float32)) is None  # not a matrix
    assert KernelConfig().cpu_packed_linear
    assert not KernelConfig.from_dict({"cpu_packed_linear": False}).cpu_packed_linear
