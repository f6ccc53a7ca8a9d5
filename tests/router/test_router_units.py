"""Router pieces without a network: config parsing, policies, prefix trees, the breaker, and the
app in front of fake workers (httpx.MockTransport) for retries, streaming and /workers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from fulcrum.router.app import build_app
from fulcrum.router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from fulcrum.router.config import ConfigError, parse_config
from fulcrum.router.policies import CacheAware, LeastLoad, RoundRobin
from fulcrum.router.prefix_tree import PrefixTree, block_hashes
from fulcrum.router.shape import RequestShape, classify, output_tokens, prompt_text
from fulcrum.router.worker import Worker, parse_load

KEY = "router-key"


# -- config ----------------------------------------------------------------------------------
def test_config_short_form_and_pools() -> None:
    cfg = parse_config({"workers": ["http://a:1/", {"url": "http://b:2", "api_key": "k"}]})
    assert cfg.policy == "round_robin" and cfg.default_pool == "default"
    assert [w.url for w in cfg.pool("default").workers] == ["http://a:1", "http://b:2"]
    assert cfg.pool("default").workers[1].api_key == "k"
    cfg = parse_config(
        {
            "policy": "shape",
            "pools": {"rag": {"policy": "cache_aware", "workers": ["http://a:1"]}, "batch": {}},
            "rules": [{"pool": "batch", "min_output_tokens": 512}],
            "default_pool": "rag",
            "max_retries": 4,
        }
    )
    assert cfg.pool("rag").policy == "cache_aware" and cfg.max_retries == 4
    assert cfg.rules[0].min_output_tokens == 512


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"policy": "fastest"}, "policy"),
        ({"workers": ["ftp://x"]}, "http://"),
        ({"policy": "shape", "workers": []}, "needs pools"),
        ({"pools": {"a": {"policy": "shape"}}}, "pools.a.policy"),
        ({"pools": {"a": {}}, "policy": "shape", "rules": [{"pool": "b"}]}, "rules[0].pool"),
        (
            {
                "pools": {"a": {}},
                "policy": "shape",
                "rules": [{"pool": "a", "min_prompt_tokens": -1}],
            },
            "min_prompt_tokens",
        ),
        ({"workers": [], "retries": 3}, "unknown key"),
        ({"workers": [], "max_retries": "x"}, "max_retries"),
        ({"pools": {"a": {}}, "default_pool": "z"}, "default_pool"),
    ],
)
def test_config_errors_name_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_config(data)


def test_config_file_yaml(tmp_path) -> None:
    from fulcrum.router.config import load_config_file

    p = tmp_path / "r.yaml"
    p.write_text("policy: cache_aware\nworkers:\n  - http://h:1\n")
    cfg = parse_config(load_config_file(str(p)), policy="least_load")
    assert cfg.policy == "least_load" and cfg.pool("default").policy == "least_load"
    p.write_text("policy: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(str(p))


# -- policies and trees ----------------------------------------------------------------------
def _workers(n: int, cfg=None) -> list[Worker]:
    cfg = cfg or parse_config({"workers": []})
    return [
        Worker(f"http://w{i}", "default", tree=PrefixTree(cfg.cache_block_chars)) for i in range(n)
    ]


def test_prefix_tree_match_and_lru_eviction() -> None:
    t = PrefixTree(block_chars=4, max_chars=16)
    a = block_hashes("aaaabbbbcccc", 4)
    t.insert(a)
    assert t.match(block_hashes("aaaabbbbxxxx", 4)) == 8
    assert t.match(block_hashes("bbbbaaaa", 4)) == 0  # the chain, not the block alone
    t.insert(block_hashes("zzzzyyyy", 4))  # 5 blocks > 4: the oldest leaf (cccc) goes
    assert t.size_chars == 16
    assert t.match(a) == 8


def test_round_robin_and_least_load() -> None:
    ws = _workers(3)
    rr = RoundRobin()
    assert [rr.choose(ws, "").worker.url for _ in range(6)] == [w.url for w in ws] * 2
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 5, 0, 9
    ws[2].reported_running = 0
    ll = LeastLoad()
    picks = {ll.choose(ws, "").worker.url for _ in range(50)}
    assert "http://w2" not in picks  # the most loaded never wins a pair
    ws[1].reported_waiting = 20  # the worker's own gauges count
    assert all(ll.choose(ws[1:], "").worker.url == "http://w2" for _ in range(10))
    assert ws[1].load == 20


def test_cache_aware_groups_stick_and_spread() -> None:
    cfg = parse_config({"workers": []})
    ws = _workers(3, cfg)
    pol = CacheAware(cfg)
    prefixes = [f"system prompt number {g} " * 20 for g in range(6)]
    where: dict[int, set[str]] = {g: set() for g in range(6)}
    for i in range(60):
        g = i % 6
        where[g].add(pol.choose(ws, prefixes[g] + f"question {i}").worker.url)
    assert all(len(s) == 1 for s in where.values())
    assert len({next(iter(s)) for s in where.values()}) == 3
    assert pol.hit_rate > 0.8
    # load imbalance past both thresholds overrides the prefix
    target = next(iter(where[0]))
    for w in ws:
        w.in_flight = 100 if w.url == target else 0
    assert pol.choose(ws, prefixes[0] + "q").worker.url != target


def test_shape_classify() -> None:
    cfg = parse_config(
        {
            "policy": "shape",
            "pools": {"chat": {}, "batch": {}, "vip": {}},
            "rules": [
                {"pool": "vip", "header": "x-tenant", "header_value": "gold"},
                {"pool": "batch", "min_output_tokens": 512, "stream": False},
            ],
            "default_pool": "chat",
        }
    )

    def shape(out, stream=False, headers=None):
        return RequestShape(10, out, stream, 1, headers or {})

    assert classify(cfg.rules, shape(1000), "chat") == "batch"
    assert classify(cfg.rules, shape(1000, stream=True), "chat") == "chat"
    assert classify(cfg.rules, shape(None), "chat") == "chat"
    assert classify(cfg.rules, shape(10, headers={"x-tenant": "gold"}), "chat") == "vip"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) == "<user>hi"
    # the Responses API: instructions as the system message, then the input (text or items)
    assert prompt_text({"instructions": "be", "input": "hi"}) == "<system>be\n<user>hi"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "function_call_output", "call_id": "c", "output": "42"}]  # fmt: skip
    assert prompt_text({"input": items}) == "<user>hi\n<function_call_output>42"
    assert output_tokens({"input": "hi", "max_output_tokens": 7}) == 7
    # embeddings: strings or token ids, read as a completion prompt
    assert prompt_text({"input": ["doc one", "doc two"]}) == "doc one"
    assert prompt_text({"input": [1, 2]}) == prompt_text({"prompt": [1, 2]})
    assert prompt_text({"query": "q", "documents": ["a"]}) == "q"  # rerank
    assert prompt_text({"text_1": ["t", "u"], "text_2": ["a", "b"]}) == "t"  # score


def test_breaker_opens_probes_and_closes() -> None:
    now = [0.0]
    b = CircuitBreaker(failure_threshold=2, cooldown_s=5, clock=lambda: now[0])
    b.record_failure()
    assert b.state == CLOSED and b.available()
    b.record_failure()
    assert b.state == OPEN and not b.available()
    now[0] = 5.0
    assert b.available()
    b.on_dispatch()
    assert b.state == HALF_OPEN and not b.available()  # one probe at a time
    b.record_failure()
    assert b.state == OPEN and not b.available()
    now[0] = 10.0
    b.on_dispatch()
    b.record_success()
    assert b.state == CLOSED and b.available()


def test_parse_load_fulcrum_and_vllm() -> None:
    text = (
        '# HELP x\nfulcrum:num_requests_running{model_name="m"} 3.0\n'
        'fulcrum:num_requests_waiting{model_name="m"} 2.0\n'
    )
    assert parse_load(text) == (3, 2)
    assert parse_load('vllm:num_requests_running{a="b"} 4\nvllm:num_requests_waiting 1\n') == (4, 1)
    assert parse_load("other 1\n") == (None, None)


# -- the app in front of fake workers ---------------------------------------------------------
def _completion(url: str) -> dict:
    return {"id": "x", "object": "chat.completion", "choices": [{"message": {"content": url}}]}


class FakeWorkers:
    """Each worker's behaviour by URL: 'ok', 'down' (connect error), '500', 'break' (stream breaks
    after one chunk). Counts requests per worker."""

    def __init__(self, modes: dict[str, str]) -> None:
        self.modes = modes
        self.hits: dict[str, int] = {u: 0 for u in modes}
        self.auth: dict[str, str | None] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        mode = self.modes[base]
        if request.url.path == "/health":
            return httpx.Response(200 if mode != "down" else 503)
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": "m", "object": "model"}]}
            )
        self.hits[base] += 1
        self.auth[base] = request.headers.get("authorization")
        if mode == "down":
            raise httpx.ConnectError("refused", request=request)
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if json.loads(request.content).get("stream"):

            async def body():
                yield b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                if mode == "break":
                    raise httpx.ReadError("connection reset")
                yield b"data: [DONE]\n\n"

            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=body()
            )
        return httpx.Response(200, json=_completion(base))


def _run(cfg_data: dict, fake: FakeWorkers, calls):
    cfg = parse_config(cfg_data)
    app = build_app(cfg, transport=httpx.MockTransport(fake), health_checks=False)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as c:
            return await calls(c, app)

    return asyncio.run(go())


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
AUTH = {"authorization": f"Bearer {KEY}"}


def test_retry_on_connect_error_and_5xx_then_breaker_opens() -> None:
    fake = FakeWorkers({"http://a:1": "down", "http://b:1": "500", "http://c:1": "ok"})

    async def calls(c, app):
        out = []
        for _ in range(6):
            r = await c.post("/v1/chat/completions", json=BODY, headers=AUTH)
            out.append((r.status_code, r.headers.get("x-fulcrum-worker")))
        return out, app.state.router.describe(), (await c.get("/metrics", headers=AUTH)).text

    cfg = {
        "workers": list(fake.modes),
        "api_key": KEY,
        "retry_backoff_s": 0.0,
        "breaker_failures": 2,
    }
    out, desc, metrics = _run(cfg, fake, calls)
    assert out == [(200, "http://c:1")] * 6
    states = {w["url"]: w["breaker"] for w in desc["pools"]["default"]["workers"]}
    assert states == {"http://a:1": "open", "http://b:1": "open", "http://c:1": "closed"}
    assert fake.hits["http://a:1"] == 2 and fake.hits["http://b:1"] == 2  # then taken out
    assert 'fulcrum_router:retries_total{pool="default"}' in metrics


def test_all_workers_fail_gives_last_upstream_error() -> None:
    fake = FakeWorkers({"http://a:1": "500", "http://b:1": "down"})

    async def calls(c, app):
        return await c.post("/v1/chat/completions", json=BODY)

    r = _run({"workers": list(fake.modes), "retry_backoff_s": 0.0, "max_retries": 1}, fake, calls)
    assert r.status_code in (500, 502)
    assert "error" in r.json()


def test_adapter_loads_reach_every_worker() -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter go to every worker, not one; a worker's
    failure comes back naming it and how many workers made the change."""
    fake = FakeWorkers({"http://a:1": "ok", "http://b:1": "ok"})
    body = {"lora_name": "x", "lora_path": "/adapters/x"}

    async def calls(c, app):
        ok = await c.post("/v1/load_lora_adapter", json=body, headers=AUTH)
        fake.modes["http://b:1"] = "500"
        bad = await c.post("/v1/unload_lora_adapter", json=body, headers=AUTH)
        return ok, bad, await c.post("/v1/load_lora_adapter", json=body)

    ok, bad, anonymous = _run({"workers": list(fake.modes), "api_key": KEY}, fake, calls)
    assert ok.status_code == 200 and fake.hits == {"http://a:1": 2, "http://b:1": 2}
    assert bad.status_code == 500
    assert bad.json()["error"]["message"] == "worker http://b:1: boom (1 of 2 workers made the change)"
    assert anonymous.status_code == 401


def test_stream_pass_through_and_mid_stream_error_event() -> None:
    fake = FakeWorkers({"http://a:1": "break"})

    async def calls(c, app):
        r = await c.post("/v1/chat/completions", json={**BODY, "stream": True})
        return r.status_code, r.headers["x-fulcrum-worker"], r.text

    status, worker, text = _run({"workers": ["http://a:1"]}, fake, calls)
    assert status == 200 and worker == "http://a:1"
    events = [e for e in text.split("\n\n") if e]
    assert events[0].startswith('data: {"choices"')
    assert json.loads(events[1][len("data: ") :])["error"]["code"] == 502
    assert events[-1] == "data: [DONE]"


def test_auth_upstream_keys_and_worker_admin() -> None:
    fake = FakeWorkers({"http://a:1": "ok", "http://b:1": "ok"})
    cfg = {"workers": [{"url": "http://a:1", "api_key": "up-a"}], "api_key": KEY}

    async def calls(c, app):
        res = {}
        res["noauth"] = (await c.post("/v1/chat/completions", json=BODY)).status_code
        r = await c.post("/v1/chat/completions", json=BODY, headers=AUTH)
        res["ok"] = r.status_code
        res["badjson"] = (await c.post("/v1/completions", content=b"{", headers=AUTH)).status_code
        res["add_noauth"] = (await c.post("/workers", json={"url": "http://b:1"})).status_code
        res["add_bad"] = (await c.post("/workers", json={"url": "b:1"}, headers=AUTH)).json()
        res["add"] = (
            await c.post("/workers", json={"url": "http://b:1"}, headers=AUTH)
        ).status_code
        res["dup"] = (
            await c.post("/workers", json={"url": "http://b:1"}, headers=AUTH)
        ).status_code
        seen = set()
        for _ in range(4):
            r = await c.post("/v1/chat/completions", json=BODY, headers=AUTH)
            seen.add(r.headers["x-fulcrum-worker"])
        res["seen"] = seen
        res["del"] = (
            await c.request("DELETE", "/workers", json={"url": "http://a:1"}, headers=AUTH)
        ).status_code
        res["del_missing"] = (
            await c.request("DELETE", "/workers", json={"url": "http://a:1"}, headers=AUTH)
        ).status_code
        res["models"] = (await c.get("/v1/models", headers=AUTH)).json()["data"]
        return res

    res = _run(cfg, fake, calls)
    assert res["noauth"] == 401 and res["ok"] == 200 and res["badjson"] == 400
    assert fake.auth["http://a:1"] == "Bearer up-a"  # the worker's key, not the router's
    assert res["add_noauth"] == 401
    assert res["add_bad"]["error"]["param"] == "url"
    assert (res["add"], res["dup"]) == (201, 400)
    assert res["seen"] == {"http://a:1", "http://b:1"}
    assert fake.auth["http://b:1"] is None
    assert (res["del"], res["del_missing"]) == (200, 404)
    assert [m["id"] for m in res["models"]] == ["m"]


def test_admin_refused_without_router_key() -> None:
    fake = FakeWorkers({"http://a:1": "ok"})

    async def calls(c, app):
        return (await c.post("/workers", json={"url": "http://b:1"})).status_code

    assert _run({"workers": ["http://a:1"]}, fake, calls) == 403
