"""Pieces of the server that need no model: template sandbox, SSE, metrics, middleware."""

from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from fulcrum.entrypoints.openai.chat_template import ChatTemplateError, render_chat
from fulcrum.entrypoints.openai.errors import OpenAIError, install_error_handlers
from fulcrum.entrypoints.openai.metrics import ServerMetrics
from fulcrum.entrypoints.openai.middleware import ServerGuard
from fulcrum.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fulcrum.entrypoints.openai.serving_base import ServeOptions, ServerState
from fulcrum.entrypoints.openai.sse import (
    DONE,
    chat_logprobs,
    completion_logprobs,
    sse_error,
    sse_event,
)
from fulcrum.protocol import SchedulerStats

TPL = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_render_chat() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(TPL, msgs) == "<user>hi<assistant>"
    assert render_chat(TPL, msgs, add_generation_prompt=False) == "<user>hi"
    assert render_chat(
        "{{ bos_token }}{{ messages | tojson }}", msgs, special_tokens={"bos_token": "<s>"}
    ).startswith('<s>[{"role"')


@pytest.mark.parametrize(
    "tpl",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% for m in messages %}{{ m.content.format_map(m) }}",
        "{{ raise_exception('no system messages') }}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_rejects_escapes(tpl: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(tpl, [{"role": "user", "content": "x"}])


def test_sse_framing() -> None:
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    body = json.loads(sse_error(OpenAIError("boom", 503, "service_unavailable_error"))[6:])
    assert body["error"]["message"] == "boom" and body["error"]["status"] == 503


def test_completion_logprobs_offsets() -> None:
    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(96 + i) for i in ids)

    lp = completion_logprobs([1, 2], None, 0, Tok(), 5, prompt_token_ids=[3])
    assert lp["tokens"] == ["c", "a", "b"] and lp["text_offset"] == [5, 6, 7]
    assert lp["token_logprobs"][0] is None


def test_logprob_bytes_rebuild_the_text(smollm_tokenizer) -> None:
    """Pieces of one emoji or CJK character decode to U+FFFD alone; their bytes join into the
    text, and the completion offsets count whole characters."""
    text = "🐱 héllo 日本"
    ids = smollm_tokenizer.encode(text)
    entries = chat_logprobs(ids, None, 0, smollm_tokenizer)
    assert "\ufffd" in "".join(e["token"] for e in entries)  # the check below is not vacuous
    assert bytes(b for e in entries for b in e["bytes"]).decode() == text
    lp = completion_logprobs(ids, None, 0, smollm_tokenizer, 0)
    assert lp["text_offset"][0] == 0 and max(lp["text_offset"]) < len(text)
    assert lp["text_offset"][ids.index(ids[-1])] == text.index("本")


def test_protocol_models() -> None:
    r = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "unknown_field": 1,
        }
    )
    assert r.messages[0].text() == "ab" and r.n == 1 and r.temperature == 1.0
    c = CompletionRequest.model_validate({"prompt": [[1, 2], [3]]})
    assert c.prompt == [[1, 2], [3]] and c.max_tokens == 16
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate_json('{"messages": [], "temperature": NaN}')


def test_null_means_the_default() -> None:
    """OpenAI types these fields "value or null"; client wrappers send null for unset ones."""
    nulls = ["temperature", "top_p", "n", "stream", "logprobs", "presence_penalty",
             "frequency_penalty", "parallel_tool_calls", "top_k", "ignore_eos"]  # fmt: skip
    body = {"messages": [{"role": "user", "content": "a"}]} | dict.fromkeys(nulls)
    r = ChatCompletionRequest.model_validate_json(json.dumps(body))
    assert (r.temperature, r.top_p, r.n, r.stream, r.logprobs) == (1.0, 1.0, 1, False, False)
    assert r.parallel_tool_calls is True and r.top_k == -1
    c = CompletionRequest.model_validate_json('{"prompt": "a", "echo": null, "max_tokens": null}')
    assert c.echo is False and c.max_tokens == 16
    with pytest.raises(ValueError, match="messages"):  # a required field stays required
        ChatCompletionRequest.model_validate_json('{"messages": null}')
    with pytest.raises(ValueError, match="temperature"):  # and a wrong type stays wrong
        ChatCompletionRequest.model_validate_json('{"messages": [], "temperature": "hot"}')


def test_metrics_registry() -> None:
    m = ServerMetrics("m")
    m.on_stats(
        SchedulerStats(
            num_running=2,
            num_blocks_total=10,
            num_blocks_free=7,
            prefix_cache_queries=30,
            prefix_cache_hits=12,
            prefix_cache_host_hits=4,
        )
    )
    m.on_prompt(5)
    m.on_tokens(3)
    m.on_first_token(0.1)
    m.on_inter_token(0.02)
    m.on_finished("length", 1.0, 0.05, 5, 3)
    text = m.render().decode()
    for line in [
        'fulcrum:num_requests_running{model_name="m"} 2.0',
        'fulcrum:kv_cache_blocks_free{model_name="m"} 7.0',
        'fulcrum:prefix_cache_hits_total{model_name="m"} 12.0',
        'fulcrum:prefix_cache_host_hits_total{model_name="m"} 4.0',
        'fulcrum:prompt_tokens_total{model_name="m"} 5.0',
        'fulcrum:generation_tokens_total{model_name="m"} 3.0',
        'fulcrum:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'fulcrum:request_queue_time_seconds_count{model_name="m"} 1.0',
    ]:
        assert line in text, line


def _guarded_app(**opts: object) -> tuple[FastAPI, ServerState]:
    state = ServerState(ServeOptions(served_model_names=["m"], **opts))  # type: ignore[arg-type]
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"n": len(await request.body())})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse({})

    app.add_middleware(ServerGuard, state=state)
    return app, state


def test_guard_key_limit_and_drain() -> None:
    from starlette.testclient import TestClient

    app, state = _guarded_app(api_key="k", max_request_bytes=100)
    with TestClient(app) as c:
        auth = {"Authorization": "Bearer k"}
        assert c.post("/v1/echo", content=b"x").status_code == 401
        assert (
            c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer z"}).status_code
            == 401
        )
        assert c.post("/v1/echo", content=b"x" * 100, headers=auth).json() == {"n": 100}
        r = c.post("/v1/echo", content=b"x" * 101, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit still holds
            for _ in range(5):
                yield b"x" * 30

        assert c.post("/v1/echo", content=chunks(), headers=auth).status_code == 413
        assert c.get("/health").status_code == 200
        state.draining = True
        assert c.post("/v1/echo", content=b"x", headers=auth).status_code == 503
        assert c.get("/health").status_code == 200
        assert state.in_flight_http == 0


@pytest.mark.parametrize("public", [False, True])
def test_key_guards_metrics_and_docs_unless_public(public: bool) -> None:
    from starlette.testclient import TestClient

    app, _ = _guarded_app(api_key="k", public_endpoints=public)
    with TestClient(app) as c:
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
            status = c.get(path).status_code
            assert status == (200 if public else 401), path
            assert c.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path
        assert c.get("/health").status_code == 200
        assert c.post("/v1/echo", content=b"x").status_code == 401


@pytest.mark.parametrize(
    "tpl",
    [
        "{{ 'x' * 1000000001 }}",
        "{{ [1] * 1000000001 }}",
        "{{ 2 ** 100000000 }}",
        "{{ '%999999999s' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ 'x'.center(1000000000) }}",
        "{{ 'x' | center(1000000000) }}",
        "{{ 'x' | indent(1000000000, true) }}",
        "{% for i in range(1000000000) %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        "{% set s = 'x' * 100000 %}{{ s.replace('x', s) | length }}",
        "{{ ('{0}' * 30000).format('x' * 100000) }}",
        "{{ ('%s' * 30000) | format(*(['x' * 100000] * 30000)) }}",
        "{{ ([s] * 100000) | join }}".replace("s", "'x' * 100000"),
        "{{ ''.join([s] * 100000) }}".replace("s", "'x' * 100000"),
        "{{ ''.join(([s] * 100000) | map('upper')) }}".replace("s", "'x' * 100000"),
    ],
)
def test_sandbox_bounds_what_a_render_builds(tpl: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render_chat(tpl, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 3


def test_sandbox_keeps_ordinary_templates() -> None:
    tpl = ("{{ '=' * 40 }}{% for m in messages %}{{ m.content.center(20) }}"
           "{{ '%5s' % m.role }}{{ '{:>3}'.format(loop.index) }}{% endfor %}{{ 2 ** 10 }}"
           "{{ range(3) | join(',') }}{{ no_such_var | default(1000000) }}{{ '%s-%s' | format(1, 2) }}")
    out = render_chat(tpl, [{"role": "user", "content": "hi"}])
    assert out == "=" * 40 + "hi".center(20) + " user  1" + "1024" + "0,1,2" + "1000000" + "1-2"


def test_render_timeout_stops_the_thread_and_leaves_the_loop_free() -> None:
    import asyncio
    import threading

    from fulcrum.entrypoints.openai.chat_template import render_chat_async

    spin = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"

    async def main() -> tuple[int, float]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        with pytest.raises(ChatTemplateError, match="took longer"):
            await render_chat_async(spin, [], timeout=0.5)
        t.cancel()
        return ticks, time.monotonic() - t0

    ticks, elapsed = asyncio.run(main())
    assert elapsed < 2 and ticks > 10  # the loop kept running while the template spun
    deadline = time.monotonic() + 5
    while any(th.name == "chat-template" for th in threading.enumerate()):
        assert time.monotonic() < deadline, "the runaway render was not stopped"
        time.sleep(0.05)


def test_template_cache_is_bounded_by_size() -> None:
    from fulcrum.entrypoints.openai import chat_template as ct

    for i in range(40):
        big = "{# " + str(i) * (ct.CACHE_CHARS // 16) + " #}{{ messages | length }}"
        assert render_chat(big, []) == "0"
    assert ct._CACHE.chars <= ct.CACHE_CHARS and len(ct._CACHE.items) < 40


def test_bounded_sandbox_renders_the_model_template_as_transformers(smollm_tokenizer) -> None:
    from fulcrum.entrypoints.openai.chat_template import special_tokens_of

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi " * 50},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And 100 % {0} more?"},
    ]
    want = smollm_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    got = render_chat(
        smollm_tokenizer.chat_template, msgs, special_tokens=special_tokens_of(smollm_tokenizer)
    )
    assert got == want
