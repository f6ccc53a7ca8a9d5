"""``worker/precompile.compile_ahead``: the plumbing, on the CPU (no kernel compiles here)."""

from __future__ import annotations

import logging

import pytest
import torch
from triton.runtime.jit import JITFunction

from fulcrum.worker import precompile


def test_compile_ahead_does_nothing_without_cuda() -> None:
    calls = []
    assert precompile.compile_ahead(lambda: calls.append(1), "test") is None
    assert calls == [] or torch.cuda.is_available()


def test_compile_ahead_runs_the_pass_once_and_restores_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(precompile.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precompile.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 4)
    run = JITFunction.run
    seen = []
    assert precompile.compile_ahead(lambda: seen.append(JITFunction.run is not run), "x") == 0
    assert seen == [True]  # launches only compiled during the pass ...
    assert JITFunction.run is run  # ... and launch again after it


def test_compile_ahead_failure_is_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(precompile.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 4)
    run = JITFunction.run

    def boom() -> None:
        raise RuntimeError("no such kernel")

    with caplog.at_level(logging.WARNING, logger="fulcrum.worker.precompile"):
        assert precompile.compile_ahead(boom, "KV profiling") is None
    assert JITFunction.run is run
    assert "Compiling ahead of KV profiling failed (no such kernel)" in caplog.text
    monkeypatch.setattr(precompile, "ENABLED", False)
    assert precompile.compile_ahead(boom, "x") is None  # switched off: not even tried
