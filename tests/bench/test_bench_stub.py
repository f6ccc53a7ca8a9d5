"""``fulcrum bench serve`` against the OpenAI stub: parsing, datasets, load modes, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import check_png, check_results, run_cli
from fake_openai import FakeServer, FakeState

COMMON = ["--disable-tqdm", "--num-warmups", "1"]


def _serve(url: str, out: Path, *extra: str) -> list[str]:
    return ["bench", "serve", "--base-url", url, "--result-file", str(out), *COMMON, *extra]


def test_random_concurrency_sweep(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = _serve(fake_server.url, out, "--num-prompts", "6", "--random-input-len", "16")
    argv += ["--random-output-len", "5", "--max-concurrency", "1,3", "--save-detailed"]
    rc, stdout, _ = run_cli(argv, capsys)
    assert rc == 0
    doc = check_results(out, num_points=2, requests_per_point=6)
    assert [p["max_concurrency"] for p in doc["points"]] == [1, 3]
    p1, p3 = doc["points"]
    assert p1["peak_concurrency"] == 1 and p3["peak_concurrency"] <= 3
    assert p1["total_output_tokens"] == 6 * 5  # usage from the stream
    assert p1["total_input_tokens"] == 6 * 16  # token-id prompts of exact length
    assert doc["server_kind"] == "fulcrum"
    assert p1["server"]["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.05)
    assert "Output token throughput" in stdout and "TTFT p50" in stdout
    body = fake_server.state.bodies[-1]
    assert isinstance(body["prompt"], list) and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_embeddings_endpoint(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    """``--endpoint embeddings``: each prompt embedded (no stream, nothing generated); its
    latency is the TTFT, input tokens come from the server's usage."""
    out = tmp_path / "e.json"
    argv = _serve(fake_server.url, out, "--endpoint", "embeddings", "--num-prompts", "4")
    argv += ["--random-input-len", "12", "--max-concurrency", "2"]
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    (p,) = check_results(out, num_points=1, requests_per_point=4)["points"]
    assert p["failed"] == 0 and p["total_input_tokens"] == 4 * 12 and p["total_output_tokens"] == 0
    assert p["ttft_ms"]["p50"] >= 5.0  # the stub's delay
    body = fake_server.state.bodies[-1]
    assert isinstance(body["input"], list) and "stream" not in body and "max_tokens" not in body


def test_prefix_repetition_poisson_chat(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "p.json"
    argv = _serve(fake_server.url, out, "--endpoint", "chat", "--dataset-name", "prefix-repetition")
    argv += ["--num-prompts", "6", "--prefix-num-prefixes", "2", "--prefix-len", "12"]
    argv += ["--prefix-suffix-len", "4", "--prefix-output-len", "3"]
    argv += ["--request-rate", "40", "--burstiness", "0.5", "--goodput", "ttft:10000", "e2el:1"]
    rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    (p,) = check_results(out, 1, 6)["points"]
    assert p["request_rate"] == 40 and p["burstiness"] == 0.5
    assert p["good_requests"] == 0  # nothing finishes in 1 ms end to end
    systems = {b["messages"][0]["content"] for b in fake_server.state.bodies[-6:]}
    assert len(systems) == 2 and all(
        b["messages"][0]["role"] == "system" for b in fake_server.state.bodies[-6:]
    )


def test_multi_turn_carries_answers(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "m.json"
    argv = _serve(fake_server.url, out, "--endpoint", "chat", "--dataset-name", "multi-turn")
    argv += ["--multi-turn-conversations", "2", "--multi-turn-turns", "3"]
    argv += [
        "--multi-turn-input-len",
        "6",
        "--multi-turn-output-len",
        "2",
        "--max-concurrency",
        "2",
    ]
    rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    check_results(out, 1, 6)
    last_turns = [b for b in fake_server.state.bodies if len(b["messages"]) == 5]
    assert len(last_turns) == 2
    roles = [m["role"] for m in last_turns[0]["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert last_turns[0]["messages"][1]["content"] == " w0 w1"  # the stub's earlier answer


def test_sharegpt_like_text_prompts(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    argv = _serve(fake_server.url, out, "--dataset-name", "sharegpt-like", "--num-prompts", "5")
    argv += [
        "--sharegpt-max-input-len",
        "40",
        "--sharegpt-output-len",
        "3",
        "--prompt-format",
        "text",
    ]
    rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    (p,) = check_results(out, 1, 5)["points"]
    assert p["total_output_tokens"] == 15
    assert all(isinstance(b["prompt"], str) for b in fake_server.state.bodies[-5:])


def test_trace_replay_keeps_arrivals(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 2,
            "arrival_time": 100.0,
        },
        {
            "request_id": "b",
            "arrival_time": 100.3,
            "endpoint": "completions",
            "model": "m",
            "prompt_token_ids": [5, 6, 7, 8],
            "prompt": None,
            "messages": None,
            "num_prompt_tokens": 4,
            "num_output_tokens": 3,
            "num_cached_tokens": 0,
            "ttft_s": 0.1,
            "e2e_s": 0.2,
            "finish_reason": "length",
            "cache_salt": None,
            "conversation_id": None,
        },
        {"model": "m", "prompt": "a plain prompt", "max_tokens": 4, "arrival_time": 100.6},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "t.json"
    argv = _serve(fake_server.url, out, "--dataset-name", "trace", "--trace-path", str(trace))
    argv += ["--num-warmups", "0", "--save-detailed"]
    rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    (p,) = check_results(out, 1, 3)["points"]
    assert p["total_output_tokens"] == 2 + 3 + 4
    assert p["duration_s"] >= 0.6  # the last request arrives 0.6 s after the first
    kinds = ["messages" in b for b in fake_server.state.bodies[-3:]]
    assert kinds == [True, False, False]


def test_failures_are_counted(tmp_path: Path, capsys) -> None:
    with FakeServer(FakeState(fail_every=3)) as srv:
        out = tmp_path / "f.json"
        argv = _serve(srv.url, out, "--num-prompts", "6", "--random-input-len", "8")
        argv += ["--random-output-len", "2", "--num-warmups", "0", "--max-concurrency", "1"]
        rc, stdout, _ = run_cli(argv, capsys)
    assert rc == 0
    (p,) = check_results(out, 1, 6)["points"]
    # Requests 1 (test) .. 7: the 3rd and 6th answer HTTP 500 -> two of the six measured.
    assert p["failed"] == 2 and p["completed"] == 4
    assert p["errors"] == {"HTTP 500: injected failure": 2}
    assert "Failed requests" in stdout


def test_output_len_without_usage_uses_tokenizer(tmp_path: Path, capsys) -> None:
    with FakeServer(FakeState(send_usage=False)) as srv:
        out = tmp_path / "u.json"
        argv = _serve(srv.url, out, "--num-prompts", "2", "--random-input-len", "8")
        argv += ["--random-output-len", "4", "--save-detailed"]
        rc, _, _ = run_cli(argv, capsys)
    assert rc == 0
    (p,) = check_results(out, 1, 2)["points"]
    from fulcrum.tokenizer import load_tokenizer

    n = len(load_tokenizer(None).encode(" w0 w1 w2 w3", add_special_tokens=False))
    assert p["total_output_tokens"] == 2 * n


def test_plot_overlays_runs(fake_server: FakeServer, tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, label in ((a, "engine-a"), (b, "engine-b")):
        argv = _serve(fake_server.url, path, "--num-prompts", "4", "--random-input-len", "8")
        argv += ["--random-output-len", "2", "--max-concurrency", "1,2", "--label", label]
        assert run_cli(argv, capsys)[0] == 0
    png = tmp_path / "both.png"
    rc, _, _ = run_cli(["bench", "plot", str(a), str(b), "-o", str(png)], capsys)
    assert rc == 0
    check_png(png)
    own = tmp_path / "own.png"
    argv = _serve(
        fake_server.url, tmp_path / "c.json", "--num-prompts", "2", "--random-input-len", "8"
    )
    argv += ["--random-output-len", "2", "--plot", str(own), "--overlay", str(a)]
    assert run_cli(argv, capsys)[0] == 0
    check_png(own)
