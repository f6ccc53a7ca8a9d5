"""The issue's acceptance tests against a real ``fulcrum serve`` on the embedded model.

Every dataset and both load modes (a concurrency sweep, Poisson arrivals) must produce complete,
internally consistent results; the plot must be a valid PNG; the server's request log must be
readable by the analyzer and replayable as a trace. Workloads are tiny (CPU CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import check_png, check_results, needs_real_server, run_cli

pytestmark = needs_real_server

BASE = ["--disable-tqdm", "--num-warmups", "0", "--save-detailed"]


def _bench(url: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--result-file", str(out), *BASE, *extra]


def _server_figures(doc: dict) -> None:
    assert doc["server_kind"] == "fulcrum"
    for p in doc["points"]:
        s = p["server"]
        assert s is not None and s["source"] == "fulcrum"
        assert s["kv_cache_usage_max"] is not None and 0.0 <= s["kv_cache_usage_max"] <= 1.0
        assert s["prefix_cache_hit_rate"] is not None and s["preemptions"] is not None


def test_random_concurrency_sweep_and_plot(real_server: str, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "random.json", tmp_path / "random.png"
    argv = _bench(real_server, out, "--num-prompts", "3", "--random-input-len", "24")
    argv += ["--random-output-len", "4", "--ignore-eos", "--max-concurrency", "1,3"]
    argv += ["--plot", str(png), "--goodput", "ttft:60000", "tpot:60000"]
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    doc = check_results(out, num_points=2, requests_per_point=3)
    for p in doc["points"]:
        assert p["failed"] == 0
        assert p["total_output_tokens"] == 3 * 4  # ignore_eos: exactly what was asked
        assert p["total_input_tokens"] == 3 * 24  # token-id prompts, counted by the server
        assert p["good_requests"] == 3
    assert doc["points"][0]["peak_concurrency"] == 1
    _server_figures(doc)
    check_png(png)
    assert "Output token throughput" in stdout


def test_prefix_repetition_poisson(real_server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "prefix.json"
    argv = _bench(real_server, out, "--endpoint", "chat", "--dataset-name", "prefix-repetition")
    argv += ["--num-prompts", "4", "--prefix-num-prefixes", "1", "--prefix-len", "64"]
    argv += ["--prefix-suffix-len", "8", "--prefix-output-len", "3", "--ignore-eos"]
    argv += ["--request-rate", "8", "--burstiness", "0.5"]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    doc = check_results(out, 1, 4)
    (p,) = doc["points"]
    assert p["failed"] == 0 and p["request_rate"] == 8
    _server_figures(doc)
    assert p["server"]["prefix_cache_hit_rate"] > 0.3  # one shared 64-token system prompt


def test_multi_turn(real_server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mt.json"
    argv = _bench(real_server, out, "--endpoint", "chat", "--dataset-name", "multi-turn")
    argv += ["--multi-turn-conversations", "2", "--multi-turn-turns", "2"]
    argv += [
        "--multi-turn-input-len",
        "12",
        "--multi-turn-output-len",
        "3",
        "--max-concurrency",
        "2",
    ]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    (p,) = check_results(out, 1, 4)["points"]
    assert p["failed"] == 0
    by_turn = {(r["session_id"], r["turn"]): r for r in p["requests"]}
    for conv in (0, 1):  # the second turn re-sends the first turn and its answer
        assert by_turn[(conv, 1)]["prompt_len"] > by_turn[(conv, 0)]["prompt_len"] + 12


def test_sharegpt_like(real_server: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sg.json"
    argv = _bench(real_server, out, "--dataset-name", "sharegpt-like", "--num-prompts", "3")
    argv += [
        "--sharegpt-max-input-len",
        "48",
        "--sharegpt-output-len",
        "3",
        "--prompt-format",
        "text",
    ]
    argv += ["--max-concurrency", "2"]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    (p,) = check_results(out, 1, 3)["points"]
    assert p["failed"] == 0 and 0 < p["total_output_tokens"] <= 9


def test_trace_replay_and_analyze_server_log(
    real_server: str, real_server_log: Path, tmp_path: Path, capsys
) -> None:
    # Runs last: by now the server has logged the requests of the tests above.
    records = [json.loads(x) for x in real_server_log.read_text().splitlines() if x.strip()]
    assert len(records) >= 6
    for key in ("request_id", "arrival_time", "endpoint", "prompt_token_ids", "num_output_tokens"):
        assert key in records[0], key
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records[-3:]))
    out = tmp_path / "trace.json"
    argv = _bench(real_server, out, "--dataset-name", "trace", "--trace-path", str(trace))
    argv += ["--trace-speedup", "20", "--ignore-eos"]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    (p,) = check_results(out, 1, 3)["points"]
    assert p["failed"] == 0
    assert p["total_output_tokens"] == sum(r["num_output_tokens"] for r in records[-3:])

    rc, stdout, err = run_cli(["analyze", str(real_server_log), "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["stats"]["num_requests"] >= len(records)
    assert rep["overlap"]["overlap"] > 0  # the prefix-repetition run shared a system prompt
    assert rep["stats"]["server_cached_fraction"] is not None
    assert rep["recommendation"]["command"].startswith("fulcrum serve")


@pytest.mark.parametrize("path", ["/v1/models"])
def test_real_server_speaks_openai(real_server: str, path: str) -> None:
    import httpx

    assert httpx.get(real_server + path, trust_env=False).json()["data"]
