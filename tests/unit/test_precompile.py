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
    calls = []
    off = precompile.compile_ahead(lambda: calls.append(1), "x", enabled=False)
    assert off is None and calls == []  # switched off: not even tried


def test_launchers_are_built_in_the_pool_and_failures_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from triton.runtime import driver

    built = []

    def launcher(src, metadata):
        if src == "bad":
            raise RuntimeError("no C compiler")
        built.append((src, metadata))

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher), raising=False)
    monkeypatch.setattr(type(driver), "active", property(lambda self: self._active), raising=False)
    kernels = [SimpleNamespace(src=s, metadata=i) for i, s in enumerate(["a", "bad", "b"])]
    with ThreadPoolExecutor(2) as pool:
        precompile._build_launchers(pool, kernels)  # the failing one is logged, not raised
        precompile._build_launchers(pool, [])  # nothing compiled: the driver is not touched
    assert sorted(built) == [("a", 0), ("b", 2)]


def test_decode_graph_dry_run_covers_the_buckets_below_each_power_of_two(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fulcrum.worker.cuda_graph import DecodeGraphs, capture_sizes

    graphs = DecodeGraphs(None, capture_sizes(384), 8, 16, 4096, torch.device("cpu"))
    ran = []
    monkeypatch.setattr(graphs, "_run_static", ran.append)
    monkeypatch.setattr(graphs, "_no_op_patch", lambda: None)
    graphs._warm_up()
    # <= 8; the powers of two; the bucket below each (56: one split, not yet sorted by context,
    # the variant the capture loop compiled before); the largest
    assert ran == [384, 256, 248, 128, 120, 64, 56, 32, 24, 16, 8, 4, 2, 1]


def test_decode_graph_dry_run_steps_every_dry_bucket_on_padding_rows() -> None:
    from fulcrum.worker.cuda_graph import DecodeGraphs, capture_sizes

    seen = []

    def forward(ids, pos, meta, out=None):
        seen.append((ids.shape[0], int(meta.slot_mapping.max()), int(meta.seq_lens.max())))
        return None, None

    DecodeGraphs(forward, capture_sizes(64), 8, 16, 4096, torch.device("cpu")).dry_run()
    # every row padding: slot -1 (no KV written), length 0 (no KV read)
    assert seen == [(b, -1, 0) for b in (64, 56, 32, 24, 16, 8, 4, 2, 1)]
