"""Kernel tests run on the CPU through Triton's interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, hence this conftest.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TRITON_IMPORTED_EARLY = False
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    _TRITON_IMPORTED_EARLY = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _interpreter_was_set_in_time() -> None:
    """Triton picks compiled or interpreted mode when a kernel is defined, its own ``tl.*``
    helpers included, so the variable above only works if nothing imported triton earlier."""
    if _TRITON_IMPORTED_EARLY:
        pytest.fail(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1 "
            "(a module collected earlier imports it); run with TRITON_INTERPRET=1 in the "
            "environment, or run tests/kernels on its own."
        )
