"""`fulcrum router` in front of three real `fulcrum serve` workers on the embedded model."""

from __future__ import annotations

import collections
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from router_helpers import ROUTER_KEY

from server.srv_helpers import MODEL


def _chat(router, content: str, max_tokens: int = 2, stream: bool = False):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    r = router.client.post("/v1/chat/completions", json=body)
    return r.status_code, r.headers.get("x-fulcrum-worker"), r.text


def test_round_robin_spreads_evenly(workers, make_router) -> None:
    router = make_router([w.base_url for w in workers], "--policy", "round_robin")
    seen = collections.Counter(_chat(router, f"Say {i}")[1] for i in range(9))
    assert seen == {w.base_url: 3 for w in workers}


def test_cache_aware_keeps_prefix_groups_together(workers, make_router) -> None:
    router = make_router([w.base_url for w in workers], "--policy", "cache_aware")
    groups = [
        f"Topic {g}: " + f"background fact number {g} about the topic. " * 8 for g in range(4)
    ]
    jobs = [(g, groups[g] + f" Question {i}?") for i in range(6) for g in range(4)]
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda job: (job[0], _chat(router, job[1])), jobs))
    assert all(status == 200 for _, (status, _, _) in results)
    by_group: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for g, (_, worker, _) in results:
        by_group[g][worker] += 1
    homes = set()
    for g, counts in by_group.items():
        worker, n = counts.most_common(1)[0]
        assert n / sum(counts.values()) >= 0.9, (g, counts)
        homes.add(worker)
    assert len(homes) == 3  # 4 groups over all 3 workers
    text = router.client.get("/metrics").text
    rate = [
        ln for ln in text.splitlines() if ln.startswith("fulcrum_router:cache_estimated_hit_rate")
    ]
    assert rate and float(rate[0].rsplit(" ", 1)[1]) > 0.5


def test_openai_client_through_router(workers, make_router) -> None:
    router = make_router([w.base_url for w in workers[:2]], "--policy", "least_load")
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content and out.usage.completion_tokens >= 1
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert raw.headers["x-fulcrum-worker"] in {w.base_url for w in workers[:2]}
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        if c.choices
    ]
    assert "".join(pieces) == out.choices[0].message.content  # greedy: same text either way
    comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert comp.choices[0].text
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert resp.output_text == out.choices[0].message.content  # the same conversation as chat
    try:  # forwarded: the text workers answer that they serve no embeddings
        client.embeddings.create(model=MODEL, input="Hi")
        raise AssertionError("a text worker served embeddings")
    except openai.BadRequestError as e:
        assert "--runner pooling" in str(e)
    bad = openai.OpenAI(base_url=router.base_url + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("the router accepted a wrong key")
    except openai.AuthenticationError:
        pass


def _metric(worker, name: str) -> float:
    text = httpx.get(worker.base_url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def _running(worker) -> float:
    return _metric(worker, "fulcrum:num_requests_running")


def test_client_disconnect_cancels_the_upstream_request(workers, make_router) -> None:
    """A client that drops a stream midway frees the worker's slot: the router closes the
    upstream connection and the worker aborts the request, long before its 400 tokens."""
    worker = workers[0]
    router = make_router([worker.base_url], "--policy", "round_robin")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    generated = _metric(worker, "fulcrum:generation_tokens_total")
    with router.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = r.iter_lines()
        for _ in range(3):
            next(chunks)
        assert _running(worker) == 1
    deadline = time.monotonic() + 20
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(worker) == 0
    assert _metric(worker, "fulcrum:generation_tokens_total") - generated < 300  # aborted


def test_killing_a_worker_loses_no_request(workers, make_router) -> None:
    """Runs last: it kills the third worker. Requests on it that had not started streaming are
    retried on the others; the health checks then take it out."""
    router = make_router(
        [w.base_url for w in workers], "--policy", "round_robin", "--health-interval", "0.5"
    )
    victim = workers[2]

    def one(i: int):
        if i == 6:
            os.kill(victim.proc.pid, signal.SIGKILL)
        return _chat(router, f"Count to {i}", max_tokens=8)

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(24)))
    assert [r[0] for r in results] == [200] * 24, results
    late = [r[1] for r in results[12:]]
    assert victim.base_url not in late[4:]  # out of rotation once its failures open the breaker
    desc = router.client.get("/workers").json()
    states = {w["url"]: w["breaker"] for w in desc["pools"]["default"]["workers"]}
    assert states[victim.base_url] != "closed"
