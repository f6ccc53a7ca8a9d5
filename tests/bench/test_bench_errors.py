"""User errors of ``fulcrum bench``: one clear line on stderr and exit code 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_helpers import run_cli
from fake_openai import FakeServer, FakeState, free_port

HERE = Path(__file__).resolve().parent


def _one_line_error(rc: int, err: str, prefix: str, *needles: str) -> None:
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def test_unreachable_url(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    rc, _, err = run_cli(["bench", "serve", "--base-url", url, "--disable-tqdm"], capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "cannot reach", url)


def test_non_openai_server(capsys) -> None:
    with FakeServer(FakeState(mode="html")) as srv:
        rc, _, err = run_cli(["bench", "serve", "--base-url", srv.url, "--disable-tqdm"], capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "not an OpenAI-compatible")


def test_server_that_does_not_stream(capsys) -> None:
    with FakeServer(FakeState(mode="no_stream")) as srv:
        rc, _, err = run_cli(["bench", "serve", "--base-url", srv.url, "--disable-tqdm"], capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "test request", "not an OpenAI stream")


def test_bad_base_url(capsys) -> None:
    rc, _, err = run_cli(["bench", "serve", "--base-url", "localhost:8000"], capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "http://")


def test_malformed_trace(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"model": "m", "prompt": "ok"}\n{"model": \n')
    argv = ["bench", "serve", "--base-url", fake_server.url, "--dataset-name", "trace"]
    rc, _, err = run_cli(argv + ["--trace-path", str(trace), "--disable-tqdm"], capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "bad.jsonl:2: malformed")


def test_bad_goodput_and_overlay(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    argv = ["bench", "serve", "--base-url", fake_server.url, "--goodput", "latency:5"]
    rc, _, err = run_cli(argv, capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "--goodput")
    not_results = tmp_path / "x.json"
    not_results.write_text(json.dumps({"hello": 1}))
    argv = ["bench", "serve", "--base-url", fake_server.url, "--overlay", str(not_results)]
    rc, _, err = run_cli(argv, capsys)
    _one_line_error(rc, err, "fulcrum bench serve: error:", "not a fulcrum bench serve results")


def test_cold_start_against_stub(tmp_path: Path, capsys) -> None:
    port = free_port()
    cmd = f"{sys.executable} {HERE / 'fake_openai.py'} --port {port} --startup-delay 0.3"
    out = tmp_path / "cold.json"
    argv = ["bench", "cold-start", "--server-cmd", cmd, "--base-url", f"http://127.0.0.1:{port}"]
    rc, stdout, err = run_cli(argv + ["-n", "2", "--result-file", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2
    for r in doc["runs"]:
        assert 0.3 <= r["time_to_health_s"] <= r["time_to_first_request_s"]
        assert r["peak_rss_bytes"] > 10 * 2**20  # a Python process with uvicorn
    assert "first request" in stdout


def test_cold_start_server_dies(tmp_path: Path, capsys) -> None:
    cmd = f"{sys.executable} -c \"import sys; print('boom: no model'); sys.exit(3)\""
    argv = [
        "bench",
        "cold-start",
        "--server-cmd",
        cmd,
        "-n",
        "1",
        "--base-url",
        "http://127.0.0.1:9",
    ]
    rc, _, err = run_cli(argv, capsys)
    _one_line_error(rc, err, "fulcrum bench cold-start: error:", "exited with code 3", "boom")
