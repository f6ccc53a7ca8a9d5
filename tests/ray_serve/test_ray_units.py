"""Ray Serve pieces without a cluster: the cache-aware request router's choice over fake
replicas, the settings' mapping onto Serve's options, the `fulcrum serve` flags, and fulcrum
importing without Ray."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.ray.app import default_options, deployment_options
from fulcrum.ray.config import RayServeConfig, require_ray
from fulcrum.ray.messages import ProxiedRequest
from fulcrum.ray.request_router import CacheAwareRequestRouter

DEP = DeploymentID(name="FulcrumEngine", app_name="fulcrum")
SYSTEM_A = "You are a careful assistant for the tax office. " * 6
SYSTEM_B = "You translate English into French, word for word. " * 6


@dataclass
class FakeReplica:
    replica_id: ReplicaID
    max_ongoing_requests: int = 100


def replicas(n: int) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(f"r{i}", DEP)) for i in range(n)]


def make_router(**kwargs: object) -> CacheAwareRequestRouter:
    r = CacheAwareRequestRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**kwargs)
    return r


_ids = iter(range(10**9))


def pending(text: str | None) -> PendingRequest:
    n = next(_ids)
    args = [] if text is None else [ProxiedRequest("POST", "/v1/completions", route_text=text)]
    meta = RequestMetadata(request_id=f"q{n}", internal_request_id=f"i{n}")
    return PendingRequest(args=args, kwargs={}, metadata=meta)


async def route(router: CacheAwareRequestRouter, reps: list[FakeReplica], text: str | None):
    """Choose like Serve (first replica of the first rank), report it routed; (replica, request)."""
    pr = pending(text)
    ranks = await router.choose_replicas(reps, pr)
    chosen = ranks[0][0]
    router.on_request_routed(pr, chosen.replica_id, None)
    return chosen, pr


def test_prefix_affinity_and_spread() -> None:
    async def go() -> None:
        router, reps = make_router(), replicas(3)
        first_a, _ = await route(router, reps, SYSTEM_A + "Q: first")
        first_b, _ = await route(router, reps, SYSTEM_B + "Q: first")
        assert first_b is not first_a  # no match: the replica with the smallest tree
        for i in range(5):
            assert (await route(router, reps, SYSTEM_A + f"Q: {i}"))[0] is first_a
            assert (await route(router, reps, SYSTEM_B + f"Q: {i}"))[0] is first_b
        # the second rank holds every other replica, so a full one never blocks a request
        ranks = await router.choose_replicas(reps, pending(SYSTEM_A + "Q: x"))
        assert ranks[0] == [first_a] and {r.replica_id for r in ranks[1]} == {
            r.replica_id for r in reps if r is not first_a
        }
        assert 0.5 < router.hit_rate < 1.0

    asyncio.run(go())


def test_imbalance_sends_to_least_loaded_then_affinity_returns() -> None:
    async def go() -> None:
        router, reps = make_router(balance_abs_threshold=4, balance_rel_threshold=1.5), replicas(2)
        home, _ = await route(router, reps, SYSTEM_A + "Q: 0")
        held = [(await route(router, reps, SYSTEM_A + f"Q: {i}"))[1] for i in range(1, 5)]
        assert router.in_flight[home.replica_id] == 5  # spread 4: within the threshold
        other = next(r for r in reps if r is not home)
        # 5 in flight against 0: past both thresholds, the prefix no longer decides
        assert (await router.choose_replicas(reps, pending(SYSTEM_A + "Q: 9")))[0] == [other]
        for pr in held:
            router.on_request_completed(home.replica_id, pr.metadata.internal_request_id)
        assert router.in_flight[home.replica_id] == 1
        assert (await router.choose_replicas(reps, pending(SYSTEM_A + "Q: 9")))[0] == [home]

    asyncio.run(go())


def test_dead_replica_forgotten_and_no_text_means_any() -> None:
    async def go() -> None:
        router, reps = make_router(), replicas(2)
        home, _ = await route(router, reps, SYSTEM_A + "Q: 0")
        assert router.trees[home.replica_id].size_chars > 0
        router.on_replica_actor_died(home.replica_id)
        assert home.replica_id not in router.trees and home.replica_id not in router.in_flight
        # a request without prompt text: one rank of all candidates (Serve takes the least queued)
        assert await router.choose_replicas(reps, pending(None)) == [reps]
        assert await router.choose_replicas(reps[:1], pending(SYSTEM_A)) == [reps[:1]]

    asyncio.run(go())


def test_replicas_map_onto_serve_options() -> None:
    args = EngineArgs(device="cpu", max_num_seqs=8)
    opts = default_options(args)
    fixed = deployment_options(RayServeConfig(num_replicas=3), args, opts)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0}
    assert fixed["max_ongoing_requests"] == 8 + opts.max_queued_requests
    router_cfg = fixed["request_router_config"]
    assert router_cfg.request_router_class == "fulcrum.ray.request_router.CacheAwareRequestRouter"
    assert router_cfg.request_router_kwargs["cache_threshold"] == 0.5
    auto = deployment_options(
        RayServeConfig(num_replicas=1, min_replicas=2, max_replicas=5), args, opts
    )
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 2,
        "max_replicas": 5,
        "initial_replicas": 2,  # clamped into the bounds
        "target_ongoing_requests": 8,
    }
    gpu = deployment_options(
        RayServeConfig(num_gpus=None), EngineArgs(device="cuda", tensor_parallel_size=2), opts
    )
    assert gpu["ray_actor_options"] == {"num_gpus": 2.0, "num_cpus": 1}
    with pytest.raises(ValueError, match="min_replicas .3. must not exceed max_replicas .2."):
        RayServeConfig(min_replicas=3, max_replicas=2)


def test_cli_ray_flags_need_ray(capsys: pytest.CaptureFixture[str]) -> None:
    from fulcrum.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--num-replicas", "2", "--max-replicas", "3"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "--num-replicas, --max-replicas need(s) --ray" in err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--ray", "--num-replicas", "0"])
    # bad bounds and a flag that does not apply fail before Ray starts
    args = parser.parse_args(["serve", "--ray", "--min-replicas", "3", "--max-replicas", "2"])
    assert args.func(args) == 2
    assert "min_replicas (3) must not exceed max_replicas (2)" in capsys.readouterr().err
    args = parser.parse_args(["serve", "--ray", "--api-server-count", "2"])
    assert args.func(args) == 2
    assert "--api-server-count does not apply with --ray" in capsys.readouterr().err
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--ray ", "--num-replicas", "--ray-address", "--min-replicas", "--max-replicas"):
        assert flag in help_text


def test_without_ray_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import fulcrum.ray

    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    with pytest.raises(ImportError, match=r"pip install fulcrum\[ray\]"):
        require_ray()
    with pytest.raises(ImportError, match=r"pip install fulcrum\[ray\]"):
        fulcrum.ray.build_app(num_replicas=2)


class FakeGen:
    """A streaming handle's response: items, or an exception raised at position ``fail_at``."""

    def __init__(self, items: list[object], fail_at: int | None = None) -> None:
        self.items, self.fail_at, self.i, self.cancelled = items, fail_at, 0, False

    def __aiter__(self) -> FakeGen:
        return self

    async def __anext__(self) -> object:
        if self.i == self.fail_at:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        if self.i >= len(self.items):
            raise StopAsyncIteration
        self.i += 1
        return self.items[self.i - 1]

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    def __init__(self, gens: list[FakeGen]) -> None:
        self.gens, self.sent = gens, 0
        self.forward = self  # engine.forward.remote(req)

    def remote(self, req: object) -> FakeGen:
        self.sent += 1
        return self.gens.pop(0)


def test_ingress_retries_a_lost_replica_and_ends_broken_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fulcrum.ray import ingress
    from fulcrum.ray.messages import ResponseHead

    monkeypatch.setattr(ingress, "RETRY_BACKOFF_S", 0.0)
    req = ProxiedRequest("POST", "/v1/completions")
    json_head = ResponseHead(200, [(b"content-type", b"application/json")], "r2")
    sse_head = ResponseHead(200, [(b"content-type", b"text/event-stream")], "r1")

    async def go() -> None:
        # lost before answering, then answered by another replica
        engine = FakeEngine([FakeGen([], fail_at=0), FakeGen([json_head, b'{"a":', b"1}"])])
        resp = await ingress.forward(engine, req)
        assert engine.sent == 2 and resp.status_code == 200 and resp.body == b'{"a":1}'
        assert resp.headers["x-fulcrum-replica"] == "r2"
        # lost every time: 503 in OpenAI's error shape after RETRIES + 1 attempts
        engine = FakeEngine([FakeGen([], fail_at=0) for _ in range(ingress.RETRIES + 1)])
        resp = await ingress.forward(engine, req)
        assert engine.sent == ingress.RETRIES + 1 and resp.status_code == 503
        assert json.loads(resp.body)["error"]["type"] == "service_unavailable_error"
        # lost mid-stream: the stream ends with an error event and [DONE], and is cancelled
        gen = FakeGen([sse_head, b"data: 1\n\n", b"data: 2\n\n"], fail_at=2)
        resp = await ingress.forward(FakeEngine([gen]), req)
        body = b"".join([c async for c in resp.body_iterator])
        assert body.startswith(b"data: 1\n\ndata: {") and body.endswith(b"data: [DONE]\n\n")
        assert b"was lost" in body and gen.cancelled

    asyncio.run(go())
