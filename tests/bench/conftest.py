"""Fixtures: the in-process OpenAI stub, and a real ``fulcrum serve`` subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from bench_helpers import SERVER_BUILT
from fake_openai import FakeServer, free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m fulcrum.entrypoints.cli serve`` on a free port; yields its base URL.

    The server also writes ``--log-requests-file``, available as ``<url>`` + the path in
    ``real_server_log``.
    """
    if not SERVER_BUILT:
        pytest.skip("fulcrum serve is not built yet")
    port = free_port()
    log_dir = tmp_path_factory.mktemp("server")
    log_file = log_dir / "requests.jsonl"
    out = open(log_dir / "stdout.log", "w")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, "-m", "fulcrum.entrypoints.cli", "serve", "--port", str(port)]
    cmd += ["--log-requests-file", str(log_file)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while True:
            if proc.poll() is not None:
                out.flush()
                tail = (log_dir / "stdout.log").read_text()[-2000:]
                pytest.fail(f"fulcrum serve exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("fulcrum serve was not healthy within 120 s")
            time.sleep(0.2)
        os.environ["FULCRUM_TEST_SERVER_LOG"] = str(log_file)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


@pytest.fixture(scope="session")
def real_server_log(real_server: str) -> Path:
    return Path(os.environ["FULCRUM_TEST_SERVER_LOG"])
