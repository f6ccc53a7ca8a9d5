"""``fulcrum bench offline``: fulcrum and transformers on one workload in one invocation."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from bench_helpers import run_cli

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fulcrum.entrypoints.llm") is None, reason="fulcrum.LLM not built"
)


def test_offline_both_backends(tmp_path: Path, capsys) -> None:
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--backend", "fulcrum,hf", "--num-prompts", "2"]
    argv += ["--random-input-len", "12", "--random-output-len", "3", "--hf-batch-size", "2"]
    argv += ["--dtype", "float32", "--device", "cpu", "--result-file", str(out), "--disable-tqdm"]
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fulcrum.bench.offline/1"
    assert [r["backend"] for r in doc["runs"]] == ["fulcrum", "hf"]
    for r in doc["runs"]:
        assert r["num_requests"] == 2 and r["total_input_tokens"] == 24
        assert r["total_output_tokens"] == 6  # ignore_eos: the requested lengths
        t = r["elapsed_s"]
        assert math.isclose(r["output_throughput"], 6 / t) and math.isclose(
            r["total_token_throughput"], 30 / t
        )
    assert "fulcrum" in stdout and "hf" in stdout


def test_offline_unknown_backend(capsys) -> None:
    rc, _, err = run_cli(["bench", "offline", "--backend", "trt"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "unknown backend 'trt'" in err
