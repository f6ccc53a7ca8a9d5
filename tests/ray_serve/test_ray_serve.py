"""Two CPU replicas of the embedded model on a local Ray cluster, behind Serve's HTTP proxy on
127.0.0.1: the official client (streaming and not), prefix affinity through the cache-aware
request router, and a replica killed by Ray replaced while requests keep succeeding."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("ray.serve")

import ray
from openai import OpenAI
from ray import serve

from fulcrum.ray import build_app
from server.srv_helpers import MODEL, SRC, free_port

SYSTEM = "You are a terse assistant for a bicycle repair shop. Answer in one short line. " * 4


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    # Picked outside the ephemeral range: Ray's processes take ports from it as they start.
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        # Ray's workers inherit this environment: they import fulcrum from this checkout.
        mp.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mp.setenv("RAY_SERVE_LOG_TO_STDERR", "0")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(num_replicas=2, max_model_len=512, kv_cache_memory=0.25, max_num_seqs=8)
        serve.run(app, name="fulcrum", route_prefix="/")
        with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60) as c:
            yield c
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: OpenAI, question: str, **kw: object) -> tuple[str, str]:
    """(answer, replica id) of a greedy chat completion."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        **kw,
    )
    return raw.parse().choices[0].message.content or "", raw.headers["x-fulcrum-replica"]


def test_openai_client_streaming_and_not(client: OpenAI) -> None:
    answer, _ = chat(client, "How do I fix a flat tire?")
    assert answer.strip()
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) >= 2 and "".join(pieces).strip()
    # streaming and not give the same greedy text
    whole = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert whole.choices[0].text == "".join(pieces)
    assert [m.id for m in client.models.list().data] == [MODEL]


def _metrics_of(base_url: str, replica: str) -> dict[str, float]:
    """One replica's samples in the ingress's merged /metrics, without the ``replica`` label."""
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    tag = f',replica="{replica}"'
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#") and tag in line:
            name, _, value = line.rpartition(" ")
            out[name.replace(tag, "")] = float(value)
    assert out, f"/metrics has no samples of replica {replica}"
    return out


def test_metrics_cover_every_replica(client: OpenAI) -> None:
    base = str(client.base_url).removesuffix("/v1/")
    chat(client, "Is a loose chain dangerous?")  # the router has listed the replicas by now
    r = httpx.get(f"{base}/metrics", timeout=10)
    replicas = r.headers["x-fulcrum-replica"].split(",")
    assert r.status_code == 200 and len(set(replicas)) == 2
    for rid in replicas:
        m = _metrics_of(base, rid)
        assert f'fulcrum:kv_cache_blocks_total{{model_name="{MODEL}"}}' in m
    # one HELP/TYPE per family, then every replica's samples
    assert r.text.count("# TYPE fulcrum:num_requests_running gauge") == 1


def _finished(m: dict[str, float], aborted: bool = False) -> float:
    """Requests finished (or, with ``aborted``, aborted) on that replica."""
    return sum(
        v
        for k, v in m.items()
        if k.startswith("fulcrum:request_success_total")
        and ('finished_reason="abort"' in k) == aborted
    )


def test_client_disconnect_aborts_the_engine_request(client: OpenAI) -> None:
    base = str(client.base_url).removesuffix("/v1/")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "stream": True}
    running = f'fulcrum:num_requests_running{{model_name="{MODEL}"}}'
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        replica = r.headers["x-fulcrum-replica"]
        lines = r.iter_lines()  # held: a dropped line iterator closes the stream
        assert next(lines).startswith("data: {")
        # the gauge comes with the engine's step stats: poll (bounded) rather than race them
        deadline = time.monotonic() + 20
        during = _metrics_of(base, replica)
        while during[running] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            during = _metrics_of(base, replica)
        assert during[running] == 1
    # the engine stops the request (running drops to 0) without finishing it
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _metrics_of(base, replica)
        if after[running] == 0:
            break
        time.sleep(0.2)
    assert after[running] == 0
    assert _finished(after) == _finished(during)
    assert _finished(after, aborted=True) == _finished(during, aborted=True) + 1


def test_prefix_affinity_and_both_replicas_serve(client: OpenAI) -> None:
    # one system prompt: every request after the first lands where its prefix is cached
    homes = {chat(client, f"Question {i}: what oils a chain?")[1] for i in range(4)}
    assert len(homes) == 1
    # other prompts match nothing there: the router sends them to the replica with less cached
    others = set()
    for i in range(2):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"{i} unrelated words about the sea " * 8, max_tokens=2
        )
        others.add(raw.headers["x-fulcrum-replica"])
    assert others - homes  # the second replica answers too


def test_killed_replica_is_replaced(client: OpenAI) -> None:
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "FulcrumEngine" in a["name"]
    ]
    assert len(names) == 2
    victim = ray.get_actor(names[0], namespace="serve")
    ray.kill(victim, no_restart=True)
    # requests keep succeeding while Serve notices and starts a replacement
    seen = set()
    for i in range(4):
        answer, replica = chat(client, f"After the crash, question {i}?")
        assert answer.strip()
        seen.add(replica)
    assert names[0].rsplit("#", 1)[1] not in seen
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "FulcrumEngine" in a["name"]
        ]
        status = serve.status().applications["fulcrum"].deployments["FulcrumEngine"].status
        if len(now) == 2 and names[0] not in now and str(status).endswith("HEALTHY"):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the killed replica was not replaced: {now}, {status}")
    new_id = next(n for n in now if n not in names).rsplit("#", 1)[1]
    # the replacement serves once the ingress's router hears of it: prompts without a cached
    # prefix go to the replica with the least cached, which is the new one
    served: list[str] = []
    deadline = time.monotonic() + 30
    while new_id not in served and time.monotonic() < deadline:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"{len(served)} fresh text about mountains " * 8, max_tokens=2
        )
        assert raw.parse().choices[0].text is not None
        served.append(raw.headers["x-fulcrum-replica"])
    assert new_id in served, served
