"""``fulcrum analyze``: both trace formats, the report and recommendation, and user errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fulcrum.entrypoints.cli import main


def _log_line(i: int, ids: list[int], t: float, **kw) -> dict:
    base = {
        "request_id": f"r{i}",
        "arrival_time": t,
        "endpoint": "completions",
        "model": "m",
        "prompt_token_ids": ids,
        "prompt": None,
        "messages": None,
        "num_prompt_tokens": len(ids),
        "num_output_tokens": 100,
        "num_cached_tokens": 0,
        "ttft_s": 0.01 + 0.0001 * len(ids),
        "e2e_s": 1.0,
        "finish_reason": "length",
        "cache_salt": None,
        "conversation_id": None,
    }
    return {**base, **kw}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_server_log_shared_prefix_keeps_cache_first_come(tmp_path: Path, capsys) -> None:
    """One shared prefix that any cache holds: the cache on, first-come order kept (lpm would
    only move the wait between requests)."""
    rng = random.Random(0)
    prefix = list(range(100, 356))  # 256 shared tokens
    suffixes = [[rng.randrange(1000, 40000) for _ in range(16 + 4 * i)] for i in range(20)]
    rows = [_log_line(i, prefix + sfx, 1000.0 + i * 0.5) for i, sfx in enumerate(suffixes)]
    total = sum(256 + len(sfx) for sfx in suffixes)
    trace = _write(tmp_path / "log.jsonl", rows)
    rc, out, err = _run(["analyze", str(trace), "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    ov = doc["overlap"]
    assert ov["hit_tokens"] == 19 * 256 and ov["prompt_tokens"] == total
    assert ov["overlap"] == pytest.approx(19 * 256 / total)
    rec = doc["recommendation"]
    assert "--enable-prefix-caching" in rec["command"] and "lpm" not in rec["command"]
    assert rec["prefill_rate_source"] == "fitted"  # the log's TTFTs grow with the prompt
    assert rec["prefill_s_per_token"] == pytest.approx(0.0001, rel=1e-6)
    assert rec["mean_ttft_saved_s"] == pytest.approx(19 * 256 * 0.0001 / 20, rel=1e-6)
    assert doc["stats"]["arrival"]["request_rate"] == pytest.approx(2.0)
    rc, text, _ = _run(["analyze", str(trace)], capsys)
    assert rc == 0 and "Recommendation:" in text and "fulcrum serve" in text


def test_unique_prompts_turn_cache_off(tmp_path: Path, capsys) -> None:
    rng = random.Random(1)
    rows = [
        _log_line(i, [i] + [rng.randrange(1000, 40000) for _ in range(60)], float(i))
        for i in range(10)
    ]
    rc, out, _ = _run(["analyze", str(_write(tmp_path / "u.jsonl", rows)), "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["overlap"]["overlap"] == 0.0
    assert "--no-enable-prefix-caching" in doc["recommendation"]["flags"]


def test_small_capacity_lowers_overlap(tmp_path: Path, capsys) -> None:
    a, b = list(range(1000, 1064)), list(range(2000, 2064))
    prompts = [a + list(range(5000, 5016)), b + list(range(6000, 6016))]
    prompts += [a + list(range(7000, 7016)), b + list(range(8000, 8016))]
    trace = _write(tmp_path / "c.jsonl", [_log_line(i, p, float(i)) for i, p in enumerate(prompts)])
    rc, out, _ = _run(["analyze", str(trace), "--json", "--capacity-tokens", "128"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["overlap"]["overlap"] == 96 / 320  # hand computed in test_analyze_sim
    assert doc["overlap_unbounded"]["overlap"] == 128 / 320


def _interleaved_prefixes(path: Path) -> Path:
    """Four 64-token prefixes, six requests each, arriving round-robin (a, b, c, d, a, ...)."""
    prefixes = [list(range(1000 * (g + 1), 1000 * (g + 1) + 64)) for g in range(4)]
    rows = [_log_line(i, prefixes[i % 4] + [9000 + i] * 16, float(i)) for i in range(24)]
    return _write(path, rows)


def test_cache_too_small_for_shared_prefixes_recommends_lpm(tmp_path: Path, capsys) -> None:
    """The shared prefixes do not fit the cache together: in arrival order each evicts the next
    one's, so longest-prefix-match scheduling is recommended (and the bigger cache)."""
    trace = _interleaved_prefixes(tmp_path / "i.jsonl")
    rc, out, _ = _run(["analyze", str(trace), "--json", "--capacity-tokens", "160"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["overlap_unbounded"]["overlap"] == pytest.approx(20 * 64 / (24 * 80))
    assert doc["overlap"]["overlap"] < 0.2
    rec = doc["recommendation"]
    assert "--schedule-policy lpm" in rec["command"] and "--enable-prefix-caching" in rec["command"]
    assert any("do not fit together" in r for r in rec["reasons"])
    rc, out, _ = _run(["analyze", str(trace), "--json"], capsys)  # unbounded: they fit
    assert "lpm" not in json.loads(out)["recommendation"]["command"]


def test_openai_chat_bodies_are_tokenized(tmp_path: Path, capsys) -> None:
    systems = [
        "You are a terse assistant who answers in one line. " * 6,
        "You translate English to French and nothing else. " * 6,
    ]
    rows = []
    for conv in range(4):
        sys_msg = {"role": "system", "content": systems[conv % 2]}
        msgs = [
            sys_msg,
            {"role": "user", "content": f"Question number {conv}: what is {conv} + 1?"},
        ]
        rows.append({"model": "smol", "messages": list(msgs), "max_tokens": 16})
        msgs += [
            {"role": "assistant", "content": f"It is {conv + 1}."},
            {"role": "user", "content": "And times two?"},
        ]
        rows.append({"model": "smol", "messages": list(msgs), "max_tokens": 16})
    trace = _write(tmp_path / "chat.jsonl", rows)
    rc, out, err = _run(["analyze", str(trace), "--json", "--block-size", "1"], capsys)
    assert rc == 0, err
    ov = json.loads(out)["overlap"]
    assert ov["num_system_prompts"] == 2
    assert ov["num_conversations"] == 4 and ov["num_multi_turn_conversations"] == 4
    assert all(g["num_requests"] == 4 for g in ov["by_system_prompt"])
    assert ov["multi_turn_overlap"] > 0.5  # second turns re-send the first
    assert 0.4 < ov["overlap"] < 1.0


@pytest.mark.parametrize(
    "content, expect",
    [
        (
            '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}\nnot json\n',
            ":2: malformed",
        ),
        ("[1, 2, 3]\n", ":1: malformed"),
        ('{"model": "m"}\n', "no 'prompt_token_ids', 'messages' or 'prompt'"),
        ('{"prompt_token_ids": ["a"]}\n', "list of integers"),
        ("\n\n", "holds no requests"),
    ],
)
def test_malformed_traces_exit_2(tmp_path: Path, capsys, content: str, expect: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(content)
    rc, out, err = _run(["analyze", str(trace)], capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and expect in err
    assert err.startswith("fulcrum analyze: error:")


def test_missing_trace_exit_2(tmp_path: Path, capsys) -> None:
    rc, _, err = _run(["analyze", str(tmp_path / "nope.jsonl")], capsys)
    assert rc == 2 and "cannot read trace" in err and len(err.strip().splitlines()) == 1


def test_recommended_command_parses(tmp_path: Path, capsys) -> None:
    import shlex

    pytest.importorskip("fulcrum.entrypoints.openai.cli_serve")
    from fulcrum.entrypoints.cli import build_parser

    trace = _interleaved_prefixes(tmp_path / "x.jsonl")
    rc, out, _ = _run(["analyze", str(trace), "--json", "--capacity-tokens", "160"], capsys)
    assert rc == 0
    cmd = json.loads(out)["recommendation"]["command"]
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert args.command == "serve" and args.schedule_policy == "lpm"


def test_recommended_speculative_config_parses(tmp_path: Path, capsys) -> None:
    """Decode-heavy at low concurrency: the recommendation names a method, and serve's parser
    takes the flag as a SpeculativeConfig."""
    import shlex

    pytest.importorskip("fulcrum.entrypoints.openai.cli_serve")
    from fulcrum.config import SpeculativeConfig
    from fulcrum.entrypoints.cli import build_parser

    rows = [_log_line(i, [7, i], i * 2.0, num_output_tokens=300) for i in range(12)]
    rc, out, _ = _run(["analyze", str(_write(tmp_path / "s.jsonl", rows)), "--json"], capsys)
    assert rc == 0
    rec = json.loads(out)["recommendation"]
    assert "--speculative-config" in rec["flags"] and not rec.get("pending_flags")
    args = build_parser().parse_args(shlex.split(rec["command"])[1:])
    assert isinstance(args.speculative_config, SpeculativeConfig)
    assert args.speculative_config.method in ("ngram", "suffix")


def test_pools_for_a_mixed_trace(tmp_path: Path, capsys) -> None:
    rng = random.Random(3)
    prefix = list(range(100, 200))
    rows = [
        _log_line(i, prefix + [rng.randrange(1000, 40000) for _ in range(8)], 1000.0 + i)
        for i in range(12)
    ]
    rows += [
        _log_line(
            12 + i,
            [rng.randrange(1000, 40000) for _ in range(20)],
            1100.0 + i,
            num_output_tokens=900,
        )
        for i in range(4)
    ]
    rows += [
        _log_line(16 + i, [rng.randrange(1000, 40000) for _ in range(20)], 1200.0 + i)
        for i in range(4)
    ]
    trace = _write(tmp_path / "mixed.jsonl", rows)
    rc, out, err = _run(["analyze", str(trace), "--json"], capsys)
    assert rc == 0, err
    pools = {p["pool"]: p for p in json.loads(out)["pools"]}
    assert {k: v["num_requests"] for k, v in pools.items()} == {
        "prefix_heavy": 12,
        "long_generation": 4,
        "interactive": 4,
    }
    assert pools["prefix_heavy"]["policy"] == "cache_aware"
    assert pools["prefix_heavy"]["share"] == pytest.approx(0.6)
    rc, text, _ = _run(["analyze", str(trace)], capsys)
    assert rc == 0 and "Router pools" in text and "prefix_heavy" in text
