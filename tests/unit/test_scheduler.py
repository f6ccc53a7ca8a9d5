"""Scheduler invariants with a stand-in model: budget respected, every request finishes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config import CacheConfig, SchedulerConfig
from fulcrum.engine.protocol import EngineCoreRequest, WireSamplingParams
from fulcrum.scheduler.scheduler import Scheduler


def _run(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Drive the scheduler; the 'model' samples token = (position * 7) % 50 + 3 (never EOS)."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        sampled = [
            (r.num_tokens * 7) % 50 + 3
            for r, n in out.scheduled
            if r.num_computed_tokens + n == r.num_tokens
        ]
        for o in sched.update(out, sampled):
            outputs.setdefault(f"{o.request_id}#{o.index}", []).extend(o.new_token_ids)
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
    sched = _sched(blocks=30, budget=budget, seqs=seqs, prefix=prefix, policy=policy)
    rng = random.Random(0)
    for i, (plen, max_tokens, n) in enumerate(reqs):
        prompt = [rng.randrange(1, 4) for _ in range(plen)]
        sched.add_request(
            EngineCoreRequest(str(i), prompt, WireSamplingParams(n=n, max_tokens=max_tokens))
        )
    outputs = _run(sched)
    for i, (_, max_tokens, n) in enumerate(reqs):
        for j in range(n):
            assert len(outputs[f"{i}#{j}"]) == max_tokens
    assert sched.kv.num_available == sched.kv.num_blocks
    assert not sched.requests


def test_abort_frees_blocks_within_a_step():
    sched = _sched()
    sched.add_request(EngineCoreRequest("a", list(range(1, 30)), WireSamplingParams(max_tokens=50)))
    sched.add_request(EngineCoreRequest("b", list(range(1, 10)), WireSamplingParams(max_tokens=50)))
    for _ in range(5):
        out = sched.schedule()
        sched.update(
            out, [5] * sum(r.num_computed_tokens + n == r.num_tokens for r, n in out.scheduled)
        )
    sched.abort_requests(["a", "b"])
    assert sched.kv.num_available == sched.kv.num_blocks
    outs = sched.update(sched.schedule(), [])
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
    assert len(first.scheduled) == 1  # the others wait for the shared prefix
    sched.update(first, [5])
    second = sched.schedule()
    assert len(second.scheduled) == 4
    hits = [r.num_cached_tokens for r, _ in second.scheduled[1:]]
    assert all(h == 32 for h in hits)


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
        computed += sum(n for r, n in out.scheduled if not r.prefill_done or r.num_computed_tokens + n <= r.num_prompt_tokens)
        sampled = [7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
        sched.update(out, sampled)
    # 33 prompt tokens once, then only the last token for each of the three siblings.
    assert computed == 33 + 3
    assert sched.kv.num_available == sched.kv.num_blocks
