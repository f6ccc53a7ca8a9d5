"""Scheduler invariants with a stand-in model: budget respected, every request finishes."""

from __future__ import annotations

import random
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config import CacheConfig, SchedulerConfig, default_max_num_batched_tokens
from fulcrum.protocol import EngineCoreRequest, WireSamplingParams
from fulcrum.scheduler.scheduler import Scheduler


def _sampled(out) -> list[int]:
    """The stand-in model: the token after position p is (p * 7) % 50 + 3 (never EOS)."""
    steps = zip(out.num_scheduled_tokens, out.num_computed_tokens, out.samples, strict=True)
    return [((s + n) * 7) % 50 + 3 for n, s, smp in steps if smp]


class _Runner:
    """What the model runner knows of the requests, rebuilt from the scheduler's outputs alone:
    a new request arrives whole, a running one with its new blocks; tokens come from collect."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def execute(self, out, sched: Scheduler) -> None:
        for rid in out.finished_req_ids:
            self.blocks.pop(rid, None)
            self.tokens.pop(rid, None)
        cached = out.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.blocks[rid] += new or []
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids)
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
        for rid in out.req_ids:
            assert self.blocks[rid] == sched.kv.block_table(rid), rid

    def collect(self, out, sampled: list[int]) -> None:
        rows = [rid for rid, smp in zip(out.req_ids, out.samples, strict=True) if smp]
        for rid, tok in zip(rows, sampled, strict=True):
            if rid in self.tokens:
                self.tokens[rid].append(tok)


def _run(sched: Scheduler, max_steps: int = 10_000, overlap: bool = False) -> dict[str, list[int]]:
    """Drive the scheduler; with ``overlap`` step N+1 is scheduled before step N's tokens are
    applied, as the engine core does with asynchronous scheduling. A stand-in runner checks
    that the outputs tell it every running request's blocks and tokens."""
    outputs: dict[str, list[int]] = {}
    inflight = None
    runner = _Runner()
    for _ in range(max_steps):
        if not sched.has_unfinished() and inflight is None:
            runner.execute(sched.schedule(), sched)  # the last finished ids
            assert not runner.blocks and not runner.tokens
            return outputs
        out = sched.schedule()
        runner.execute(out, sched)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        assert all(r.num_pending <= 1 + overlap for r in sched.running)
        done, inflight = (inflight, out) if overlap else (out, None)
        if inflight is not None and inflight.is_empty:
            inflight = None
        if done is not None:
            runner.collect(done, _sampled(done))
            for o in sched.update(done, _sampled(done)) + sched.take_aborted():
                outputs.setdefault(f"{o.request_id}#{o.index}", []).extend(o.new_token_ids)
        for r in sched.running:
            assert runner.tokens[r.key] == r.all_token_ids
        sched.kv.check_integrity()
    raise AssertionError("scheduler did not finish")


def _sched(blocks=40, budget=16, seqs=8, bs=4, prefix=True, policy="fcfs") -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=budget,
            max_model_len=128,
            schedule_policy=policy,
        ),
        CacheConfig(block_size=bs, enable_prefix_caching=prefix),
        num_blocks=blocks,
        vocab_size=64,
        eos_token_ids={0},
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(1, 3)),
        min_size=1,
        max_size=12,
    ),
    st.integers(4, 24),
    st.integers(1, 6),
    st.booleans(),
    st.sampled_from(["fcfs", "lpm"]),
)
def test_every_request_finishes_with_its_length(reqs, budget, seqs, prefix, policy):
    results = []
    for overlap in (False, True):
        sched = _sched(blocks=30, budget=budget, seqs=seqs, prefix=prefix, policy=policy)
        rng = random.Random(0)
        for i, (plen, max_tokens, n) in enumerate(reqs):
            prompt = [rng.randrange(1, 4) for _ in range(plen)]
            sched.add_request(
                EngineCoreRequest(str(i), prompt, WireSamplingParams(n=n, max_tokens=max_tokens))
            )
        outputs = _run(sched, overlap=overlap)
        for i, (_, max_tokens, n) in enumerate(reqs):
            for j in range(n):
                assert len(outputs[f"{i}#{j}"]) == max_tokens
        assert sched.kv.num_available == sched.kv.num_blocks
        assert not sched.requests
        results.append(outputs)
    assert results[0] == results[1]  # overlapped scheduling changes no token


def test_abort_frees_blocks_within_a_step():
    sched = _sched()
    sched.add_request(EngineCoreRequest("a", list(range(1, 30)), WireSamplingParams(max_tokens=50)))
    sched.add_request(EngineCoreRequest("b", list(range(1, 10)), WireSamplingParams(max_tokens=50)))
    for _ in range(5):
        out = sched.schedule()
        sched.update(out, [5] * out.num_sampled)
    inflight = sched.schedule()  # launched, then aborted before its tokens come back
    sched.abort_requests(["a", "b"])
    assert sched.kv.num_available == sched.kv.num_blocks
    assert sched.update(inflight, [5] * inflight.num_sampled) == []  # late tokens are dropped
    assert sched.schedule().is_empty
    outs = sched.take_aborted()
    assert {(o.request_id, o.finish_reason) for o in outs} == {("a", "abort"), ("b", "abort")}
    assert not sched.has_unfinished()


def test_shared_prefix_in_one_step_is_computed_once():
    sched = _sched(blocks=64, budget=256, bs=4)
    shared = list(range(1, 33))
    for i in range(4):
        sched.add_request(
            EngineCoreRequest(str(i), shared + [40 + i] * 3, WireSamplingParams(max_tokens=2))
        )
    first = sched.schedule()
    # The first request's prompt blocks enter the cache when scheduled; the others reuse them
    # in the same step (each layer writes K/V before it attends), computing only their tails.
    assert first.num_reqs == 4
    assert first.num_batched_tokens == 35 + 3 * 3
    hits = [r.num_computed_tokens for r in first.scheduled_new_reqs[1:]]
    assert hits == [32, 32, 32]
    assert [r.num_cached_tokens for r in sched.running[1:]] == hits


def test_bad_requests_name_the_field():
    sched = _sched(blocks=4)
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(EngineCoreRequest("x", [1] * 200, WireSamplingParams()))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(EngineCoreRequest("y", [1, 64], WireSamplingParams()))
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(EngineCoreRequest("z", [], WireSamplingParams()))
    with pytest.raises(ValueError, match="prompt"):  # needs more blocks than the pool has
        sched.add_request(EngineCoreRequest("w", [1] * 20, WireSamplingParams()))


@pytest.mark.parametrize("prefix", [True, False])
def test_n_sequences_share_one_prefill(prefix):
    sched = _sched(blocks=64, budget=512, bs=4, prefix=prefix)
    sched.add_request(EngineCoreRequest("p", list(range(1, 34)), WireSamplingParams(n=4, max_tokens=3)))
    computed = 0
    for _ in range(50):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        computed += sum(
            min(n, 33 - s)
            for n, s in zip(out.num_scheduled_tokens, out.num_computed_tokens, strict=True)
            if s < 33
        )
        sched.update(out, [7] * out.num_sampled)
    # 33 prompt tokens once, then only the last token for each of the three siblings.
    assert computed == 33 + 3
    assert sched.kv.num_available == sched.kv.num_blocks


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=2, max_size=10),
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=6),
    st.booleans(),
)
def test_aborts_while_a_step_is_in_flight(reqs, aborts, prefix):
    """Overlapped scheduling with aborts landing between launch and collection: late tokens are
    dropped, the aborted get one abort output each, the rest finish, and every block comes back."""
    sched = _sched(blocks=24, budget=12, seqs=4, prefix=prefix)
    rng = random.Random(1)
    for i, (plen, max_tokens) in enumerate(reqs):
        prompt = [rng.randrange(1, 4) for _ in range(plen)]
        sched.add_request(EngineCoreRequest(str(i), prompt, WireSamplingParams(max_tokens=max_tokens)))
    plan: dict[int, list[str]] = {}
    for step, idx in aborts:
        plan.setdefault(step, []).append(str(idx % len(reqs)))
    outputs: dict[str, list] = {}
    inflight = None
    for step in range(2000):
        if not sched.has_unfinished() and inflight is None:
            break
        out = sched.schedule()
        done, inflight = inflight, (None if out.is_empty else out)
        sched.abort_requests(plan.get(step, []))  # lands while ``out`` is in flight
        results = (sched.update(done, _sampled(done)) if done is not None else [])
        for o in results + sched.take_aborted():
            outputs.setdefault(o.request_id, []).append(o)
        sched.kv.check_integrity()
    else:
        raise AssertionError("scheduler did not finish")
    aborted = {rid for ids in plan.values() for rid in ids}
    for i, (_, max_tokens) in enumerate(reqs):
        outs = outputs[str(i)]
        reasons = [o.finish_reason for o in outs if o.finish_reason is not None]
        assert len(reasons) == 1, (i, reasons)  # exactly one final output per request
        if reasons[0] == "length":
            assert sum(len(o.new_token_ids) for o in outs) == max_tokens
        else:
            assert reasons[0] == "abort" and str(i) in aborted
    assert sched.kv.num_available == sched.kv.num_blocks
    assert not sched.requests


def test_running_requests_send_only_what_changed():
    """A decode step names each running request with no copy of its tokens or block table;
    a block id travels once, when the table grows."""
    sched = _sched(blocks=64, budget=64, bs=4)
    for i in range(3):
        sched.add_request(EngineCoreRequest(str(i), [1 + i] * 5, WireSamplingParams(max_tokens=9)))
    first = sched.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["0#0", "1#0", "2#0"]
    assert [len(r.block_ids) for r in first.scheduled_new_reqs] == [2, 2, 2]
    sched.update(first, _sampled(first))
    for _ in range(8):
        out = sched.schedule()
        assert not out.scheduled_new_reqs and out.num_scheduled_tokens == [1, 1, 1]
        cached = out.scheduled_cached_reqs
        for new, start in zip(cached.new_block_ids, cached.num_computed_tokens, strict=True):
            # position ``start`` opens a block exactly when it is a multiple of 4
            assert (new is not None) == (start % 4 == 0)
            assert new is None or len(new) == 1
        sched.update(out, _sampled(out))
    assert sorted(sched.schedule().finished_req_ids) == ["0#0", "1#0", "2#0"]


def test_preempted_request_comes_back_whole():
    sched = _sched(blocks=6, budget=32, bs=4)
    sched.add_request(EngineCoreRequest("a", [1] * 7, WireSamplingParams(max_tokens=12)))
    sched.add_request(EngineCoreRequest("b", [2] * 7, WireSamplingParams(max_tokens=12)))
    seen_preempt = False
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            r = next(s for s in sched.running if s.key == new.req_id)
            assert new.prompt_token_ids + new.output_token_ids == r.all_token_ids
            if seen_preempt and new.output_token_ids:
                assert new.num_computed_tokens % 4 == 0 and new.block_ids
        seen_preempt |= bool(out.preempted_req_ids)
        outs.append(out)
        sched.update(out, _sampled(out))
    assert seen_preempt
    assert any(n.output_token_ids for o in outs for n in o.scheduled_new_reqs)


def test_first_output_carries_the_first_scheduled_time():
    import time

    sched = _sched(budget=8)
    t0 = time.time()
    sched.add_request(EngineCoreRequest("a", list(range(1, 20)), WireSamplingParams(max_tokens=3)))
    outs = _run_collect(sched)
    assert [o.first_scheduled_time is not None for o in outs] == [True, False, False]
    assert t0 <= outs[0].first_scheduled_time <= time.time()


def _run_collect(sched: Scheduler) -> list:
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs += sched.update(out, _sampled(out))
    return outs


def test_step_budget_default_follows_the_device(monkeypatch) -> None:
    """No budget given: 2048 on the CPU and on small GPUs, 8192 on a GPU of 70 GiB or more; a
    given budget is kept."""
    assert default_max_num_batched_tokens(torch.device("cpu")) == 2048
    for gib, want in ((80, 8192), (141, 8192), (24, 2048)):
        props = types.SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d, p=props: p)
        assert default_max_num_batched_tokens(torch.device("cuda", 0)) == want, gib


def test_priority_orders_admission_and_preemption():
    """Lower priority values are admitted first; when blocks run out the running request with
    the highest value gives way, though it is the oldest, and finishes last."""
    sched = _sched(blocks=6, budget=64, seqs=2, bs=4, prefix=False)
    params = WireSamplingParams(max_tokens=12)
    sched.add_request(EngineCoreRequest("low", [1] * 7, params, priority=5))
    out = sched.schedule()
    sched.update(out, _sampled(out))
    for rid, prio in (("late", 9), ("top", 0)):
        sched.add_request(EngineCoreRequest(rid, [2] * 7, params, priority=prio))
    order, preempted = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted_req_ids
        order += [r.req_id for r in out.scheduled_new_reqs]
        order += [f"done {o.request_id}" for o in sched.update(out, _sampled(out)) if o.finish_reason]
    # 6 blocks of 4 tokens hold one 7 + 12 token sequence and part of another
    assert order[0] == "top#0" and preempted[0] == "low#0" and "top#0" not in preempted
    assert order.index("done top") < order.index("done low") < order.index("done late")


def test_preempted_request_keeps_its_priority_in_the_queue():
    """A preempted request goes back to the queue's front among equals only: a waiting
    request with a lower value is admitted before it."""
    from fulcrum.scheduler.policy import order_waiting

    sched = _sched(blocks=6, budget=64, seqs=2, bs=4, prefix=False)
    params = WireSamplingParams(max_tokens=12)
    sched.add_request(EngineCoreRequest("a", [1] * 7, params, priority=0))
    sched.add_request(EngineCoreRequest("b", [2] * 7, params, priority=3))
    out = sched.schedule()
    sched.update(out, _sampled(out))
    sched.add_request(EngineCoreRequest("c", [3] * 7, params, priority=1))  # seats are full
    while not sched.num_preemptions:
        out = sched.schedule()
        sched.update(out, _sampled(out))
    assert [r.key for r in sched.running] == ["a#0"]
    assert [r.key for r in sched.waiting] == ["b#0", "c#0"]
    assert [r.key for r in order_waiting(sched.waiting, sched.kv, sched.config)] == ["c#0", "b#0"]
