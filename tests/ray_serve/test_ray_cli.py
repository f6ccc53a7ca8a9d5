"""`fulcrum serve --ray --ray-address` joins a Ray cluster that `ray start` runs apart: the command
line end to end, answering the official client, and leaving the user's cluster up when it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from openai import OpenAI

from server.srv_helpers import MODEL, SRC, free_port

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait: float = 60) -> int:
    """Signal the process group; its exit status (killed if it outlasts ``wait``)."""
    try:
        os.killpg(proc.pid, sig)
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(30)
    except ProcessLookupError:
        return proc.wait(30)


def test_serve_cli_joins_an_existing_cluster(tmp_path) -> None:
    gcs, http = free_port(), free_port()
    address = f"127.0.0.1:{gcs}"
    # The cluster's workers import fulcrum from this checkout. A cluster `ray start` creates turns
    # token authentication on unless told otherwise; this one, on 127.0.0.1 for the test, does not.
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               RAY_SERVE_LOG_TO_STDERR="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    with open(tmp_path / "head.log", "wb") as head_log, open(tmp_path / "serve.log", "wb") as log:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--port={gcs}",
             "--num-cpus=3", "--include-dashboard=false", "--disable-usage-stats"],
            env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        serve = None
        try:
            serve = subprocess.Popen(
                [sys.executable, "-m", "fulcrum.entrypoints.cli", "serve", "--ray",
                 "--ray-address", address, "--num-replicas", "1", "--host", "127.0.0.1",
                 "--port", str(http), "--max-model-len", "512", "--kv-cache-memory", "0.25",
                 "--max-num-seqs", "4"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            base = f"http://127.0.0.1:{http}"
            deadline = time.monotonic() + 240
            while True:  # the head, then Serve's proxy and the replica's engine come up
                assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                try:
                    if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            with OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60) as client:
                out = client.completions.create(
                    model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
                )
            assert out.choices[0].text.strip()
            assert _stop(serve) == 0, (tmp_path / "serve.log").read_text()[-3000:]
            serve = None
            # the app is gone, the cluster it joined is not
            status = subprocess.run(
                [RAY, "status", "--address", address], env=env, capture_output=True, timeout=60
            )
            assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
        finally:
            if serve is not None:
                _stop(serve, signal.SIGKILL)
            _stop(head, signal.SIGKILL)  # a drain on SIGTERM waits up to 30 s; nothing to keep
