"""Programmatic dependent launch: which launches use it (on a Hopper GPU, tests/gpu checks the
modes, and its kernel and engine tests run with it on)."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels import pdl


def test_off_without_cuda() -> None:
    assert pdl.mode(torch.empty(4), 1) == pdl.OFF
    assert pdl.launch_options(pdl.OFF) == {}


@pytest.mark.parametrize("m", [pdl.WAIT, pdl.EARLY, pdl.PRE])
def test_launch_options(m: int) -> None:
    assert pdl.launch_options(m) == {"launch_pdl": True}
