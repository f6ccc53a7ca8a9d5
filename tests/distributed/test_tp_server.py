"""``fulcrum serve -tp 2`` on a tiny model answers the official client; a killed rank turns
into 503s, the server exits non-zero, and no process of it is left."""

from __future__ import annotations

import os
import signal
import sys
import time

import openai
import psutil
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
from srv_helpers import start_server, stop_server  # noqa: E402


def _ranks(pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_server_tp2_answers_then_fails_cleanly(tiny_models, tmp_path):
    path = tiny_models["llama"]
    server = start_server(
        str(tmp_path), "--model", path, "-tp", "2", "--device", "cpu", "--dtype", "float32",
        "--kv-cache-memory", "0.01", "--worker-timeout", "60",
    )  # fmt: skip
    try:
        family = psutil.Process(server.proc.pid).children(recursive=True)
        ranks = _ranks(server.proc.pid)
        assert len(ranks) == 2  # the engine core (rank 0) and rank 1
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model=path, prompt=[1, 5, 9, 33, 2, 7], max_tokens=8, temperature=0
        )
        assert out.usage.completion_tokens == 8
        rank1 = max(ranks, key=lambda p: p.create_time())  # spawned by the core, after it
        os.kill(rank1.pid, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            for _ in range(20):  # the next request, or the one after the core noticed
                client.completions.create(model=path, prompt=[1, 2, 3], max_tokens=4)
                time.sleep(0.2)
        assert e.value.status_code == 503
        assert "rank 1" in str(e.value) or "engine" in str(e.value)
        assert server.proc.wait(60) != 0
        gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, alive
        with open(server.output_file) as f:
            assert "tensor-parallel rank 1" in f.read()
    finally:
        stop_server(server)
