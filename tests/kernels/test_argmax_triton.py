from __future__ import annotations

import pytest
import torch

from fulcrum.config import KernelConfig
from fulcrum.kernels.argmax import MAX_ROWS, argmax_rows


@pytest.mark.parametrize(
    ("n", "vocab", "dtype"),
    [(1, 5000, torch.float32), (3, 1024, torch.float32), (2, 3001, torch.bfloat16)],
)
def test_argmax_rows_matches_torch(n: int, vocab: int, dtype: torch.dtype) -> None:
    """Random rows, ties inside a chunk and across chunks (the first index wins), a row of
    -inf with one finite value, a NaN (ranked above every number, as torch does)."""
    g = torch.Generator().manual_seed(n * vocab)
    x = torch.randn(n, vocab, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    x[0, 700] = x[0, 900] = 50.0  # same chunk of the interpreter's 1,024
    x[0, vocab - 1] = 50.0  # a later chunk
    if n > 1:
        x[1] = float("-inf")
        x[1, vocab - 2] = -3.0
    if n > 2:
        x[2, 17] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(x)[0] == 700


def test_argmax_rows_strided_rows_and_limits() -> None:
    base = torch.randn(2, 300)
    x = base[:, :250]  # row stride 300
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="argmax_rows"):
        argmax_rows(torch.randn(MAX_ROWS + 1, 10))


def test_greedy_argmax_takes_the_kernel_where_triton_runs(monkeypatch: pytest.MonkeyPatch):
    """The greedy sampler's argmax runs the kernel for a few rows (on CUDA; here the
    interpreter stands in) and torch's argmax beyond ``MAX_ROWS`` or with the switch off."""
    import fulcrum.worker.sampler as sampler_mod
    from fulcrum.kernels import argmax as argmax_mod

    calls = []
    real = argmax_mod.argmax_rows
    monkeypatch.setattr(
        argmax_mod, "argmax_rows", lambda x, out=None, *a: calls.append(len(x)) or real(x, out)
    )
    monkeypatch.setattr(sampler_mod, "use_triton", lambda *a: True)
    for n, enabled in ((1, True), (4, True), (MAX_ROWS + 1, True), (2, False)):
        kc = KernelConfig(argmax_kernel=enabled)
        x = torch.randn(n, 2048)
        assert torch.equal(sampler_mod.greedy_argmax(x, None, kc), x.argmax(-1))
        out = torch.full((n,), -1, dtype=torch.int64)  # a decode graph's shared ids buffer
        got = sampler_mod.greedy_argmax(x, out, kc)
        assert got is out and torch.equal(out, x.argmax(-1))
    assert calls == [1, 1, 4, 4]
