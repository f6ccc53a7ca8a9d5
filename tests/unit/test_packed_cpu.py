"""The oneDNN-packed copy of a CPU linear layer's weight (model/layers/packed_cpu.py): the same
products as ``F.linear`` for every row count, taken only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulcrum.config import KernelConfig
from fulcrum.model.layers.linear import Linear
from fulcrum.model.layers.packed_cpu import PACKED_MAX_ROWS, pack_linear_weights, pack_weight

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_for_every_row_count(bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    model = torch.nn.Sequential(layer)
    assert pack_linear_weights(model, Linear) == 1 and layer.packed is not None
    for rows in (1, 2, 5, 9, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed() -> None:
    fp32, bf16 = Linear(32, 48, bias=False), Linear(32, 48, bias=False).to(torch.bfloat16)
    plain = torch.nn.Linear(32, 48)
    model = torch.nn.Sequential(fp32, bf16, plain)
    assert pack_linear_weights(model, Linear) == 1
    assert fp32.packed is not None and bf16.packed is None and not hasattr(plain, "packed")
    assert pack_weight(torch.zeros(4, dtype=torch.float32)) is None  # not a matrix
    assert KernelConfig().cpu_packed_linear
    assert not KernelConfig.from_dict({"cpu_packed_linear": False}).cpu_packed_linear
