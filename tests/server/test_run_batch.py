"""`fulcrum run-batch`: OpenAI batch requests (JSONL) through the engine offline, one result per
line in the input's order, each as the server answers it (a 400 body for a bad request); lines
that are no request get an error naming the line and the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from srv_helpers import MODEL, SRC


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fulcrum.entrypoints.cli", "run-batch", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_run_batch_answers_each_line_in_order(tmp_path) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}  # fmt: skip
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "comp", "url": "/v1/completions",
         "body": {"prompt": "The capital of France is", "max_tokens": 3, "n": 2}},
        {"custom_id": "bad", "url": "/v1/completions", "body": {"prompt": "Hi", "temperature": -1}},
        "not json",
        {"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "Hi", "stream": True}},
        {"custom_id": "chat", "url": "/v1/completions", "body": {"prompt": "Hi"}},
        {"custom_id": "where", "url": "/v1/files", "body": {}},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(ln if isinstance(ln, str) else json.dumps(ln) for ln in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    r = _run("-i", str(src), "-o", str(out), "--max-model-len", "256", "--kv-cache-memory", "0.05")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [x["custom_id"] for x in recs] == ["chat", "comp", "bad", None, "stream", "chat", "where"]
    ok = recs[0]["response"]
    assert ok["status_code"] == 200 and ok["body"]["object"] == "chat.completion"
    assert ok["request_id"] == ok["body"]["id"] and ok["body"]["usage"]["completion_tokens"] == 5
    assert len(recs[1]["response"]["body"]["choices"]) == 2
    assert recs[2]["response"]["status_code"] == 400
    assert recs[2]["response"]["body"]["error"]["param"] == "temperature"
    errors = [x["error"]["message"] for x in recs[3:]]
    assert errors[0].startswith("line 4: the line is not JSON")
    assert errors[1] == "line 5: body.stream: a batch request cannot stream"
    assert errors[2].startswith("line 6: custom_id: 'chat' appears twice")
    assert errors[3].startswith("line 7: url: expected one of /v1/chat/completions")
    assert all(x["response"] is None for x in recs[3:])
    assert "7 requests, 2 answered 200" in r.stderr
    missing = _run("-i", str(tmp_path / "nope.jsonl"), "-o", str(out))
    assert missing.returncode == 2 and "--input-file: cannot read" in missing.stderr
