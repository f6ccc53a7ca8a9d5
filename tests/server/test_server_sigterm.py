"""A second server: admission limit (429), trusted request templates, and SIGTERM draining."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from srv_helpers import MODEL, Server, start_server, stop_server, wait_idle

SHUTDOWN_TIMEOUT = 15.0


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        str(tmp_path_factory.mktemp("small")),
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "1",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT),
        "--trust-request-chat-template",
        "--max-model-len",
        "2048",
        "--max-tokens-default",
        "3",
        "--max-tokens-limit",
        "1000",
    )
    yield s
    stop_server(s)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SSEReader(threading.Thread):
    """Streams one chat request over raw HTTP and records every event."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.events: list[str] = []
        self.started_streaming = threading.Event()
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)

    def hang_up(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> None:
        conn = self.conn
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        buf = b""
        while True:
            try:
                chunk = resp.read1(65536)
            except (OSError, http.client.HTTPException):
                break
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                self.events.append(event.decode())
                if '"content":"' in event.decode() and '"content":""' not in event.decode():
                    self.started_streaming.set()
        conn.close()

    def payloads(self) -> list[Any]:
        return [json.loads(e[6:]) for e in self.events if e != "data: [DONE]"]


def test_trusted_request_chat_template(small_server: Server) -> None:
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "chat_template": tpl,
    }
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 200 and out["usage"]["prompt_tokens"] < 15  # no default system prompt
    body["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "chat_template"


def test_hostile_request_templates_are_400_and_never_stall(small_server: Server) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 4, "chat_template": "{{ 'x' * 1000000001 }}"}
    t0 = time.monotonic()
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "chat_template", out
    assert time.monotonic() - t0 < 5
    # A template that loops without output runs until the render timeout; /health and the
    # next request are served meanwhile, and the render ends in a 400 naming the timeout.
    slow = dict(body, chat_template="{% for a in range(100000) %}{% for b in range(100000) %}"
                "{% endfor %}{% endfor %}")
    result: list[Any] = []
    worker = threading.Thread(
        target=lambda: result.append(small_server.json("POST", "/v1/chat/completions", slow))
    )
    worker.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert small_server.request("GET", "/health", key=None)[0] == 200
    assert small_server.json("POST", "/tokenize", {"prompt": "Hi"})[0] == 200
    assert time.monotonic() - t0 < 2, "the event loop was blocked"
    worker.join(60)
    status, out = result[0]
    assert status == 400 and "took longer" in out["error"]["message"], out


def test_queue_limit_is_429(small_server: Server) -> None:
    readers = [SSEReader(small_server, 1000) for _ in range(3)]  # 2 running + 1 waiting
    for r in readers:
        r.start()
    deadline = time.monotonic() + 60
    while small_server.metrics().get("fulcrum:num_requests_in_flight", 0) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    c = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
    status, data, _ = small_server.request("POST", "/v1/completions", {"prompt": "x"}, key=None)
    assert status == 429 and json.loads(data)["error"]["type"]
    for r in readers:  # hang up: the server aborts them and is idle again
        r.hang_up()
    wait_idle(small_server, timeout=120)


def test_max_tokens_default_and_limit(small_server: Server) -> None:
    msgs = [{"role": "user", "content": "Tell a long story."}]
    body = {"model": MODEL, "messages": msgs, "ignore_eos": True}
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"
    status, out = small_server.json("POST", "/v1/completions", {"prompt": "A", "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 16  # OpenAI's default
    for path, extra in [("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "A"})]:
        status, out = small_server.json("POST", path, {**body, **extra, "max_tokens": 1001})
        assert status == 400 and out["error"]["param"] == "max_tokens", out
        assert "at most 1000" in out["error"]["message"]
    _, schema = small_server.json("GET", "/openapi.json")
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 1000


def test_queue_limit_counts_sequences(small_server: Server) -> None:
    wait_idle(small_server)
    # 2 running + 1 queued sequences fit; one request of 4 sequences never can.
    msgs = [{"role": "user", "content": "x"}]
    status, out = small_server.json("POST", "/v1/chat/completions", {"messages": msgs, "n": 4})
    assert status == 400 and out["error"]["code"] == "too_many_sequences", out
    assert "4 sequences" in out["error"]["message"]
    status, out = small_server.json("POST", "/v1/completions", {"prompt": ["a", "b"], "n": 2})
    assert status == 400 and out["error"]["param"] == "n", out
    status, out = small_server.json("POST", "/v1/completions", {"prompt": ["a"] * 4})
    assert status == 400 and out["error"]["param"] == "prompt", out  # too many prompts, not n
    readers = [SSEReader(small_server, 1000) for _ in range(2)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + 60
    while small_server.metrics().get("fulcrum:num_requests_in_flight", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    body = {"messages": msgs, "n": 2, "max_tokens": 2}
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 429 and out["error"]["code"] == "rate_limit_exceeded", out
    for r in readers:
        r.hang_up()
    wait_idle(small_server, timeout=120)
    status, out = small_server.json("POST", "/v1/chat/completions", body)
    assert status == 200 and len(out["choices"]) == 2


def test_sigterm_drains_then_exits_zero(small_server: Server) -> None:
    short, long = SSEReader(small_server, 6), SSEReader(small_server, 1000)
    short.start()
    long.start()
    assert short.started_streaming.wait(120) and long.started_streaming.wait(120)
    kids = _children(small_server.proc.pid)
    assert kids, "the engine core runs in a child process"
    small_server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the signal is handled asynchronously; new work is refused within moments
        status, data, _ = small_server.request(
            "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=None
        )
        if status == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 503 and json.loads(data)["error"]["code"] == "server_shutting_down"
    assert small_server.request("GET", "/ready", key=None)[0] == 503
    assert small_server.request("GET", "/health", key=None)[0] == 200
    short.join(60)
    finals = [c for c in short.payloads() if c.get("usage")]
    reasons = [
        ch["finish_reason"]
        for c in short.payloads()
        for ch in c.get("choices", [])
        if ch.get("finish_reason")
    ]
    assert reasons == ["length"] and finals[0]["usage"]["completion_tokens"] == 6
    assert short.events[-1] == "data: [DONE]"
    assert small_server.proc.wait(SHUTDOWN_TIMEOUT + 60) == 0
    long.join(30)
    # The long request outlived the timeout: an error event, then [DONE].
    assert long.events[-1] == "data: [DONE]" and "error" in long.payloads()[-1]
    time.sleep(0.5)
    assert not [k for k in kids if _alive(k)], "child processes left behind"
