"""The sort-free sampler (``kernels/sample.py``) inside the engine, on the CPU through
Triton's interpreter: which batches it serves, and that it keeps what must not change."""

from __future__ import annotations

import pytest

from fulcrum import LLM, SamplingParams


def test_one_launch_sampler_serves_plain_sampling_batches(tiny_models, monkeypatch) -> None:
    import fulcrum.worker.step_sampling as mr

    monkeypatch.setattr(mr, "use_triton", lambda *a: True)  # the CUDA path, interpreted
    calls: list[int] = []
    real = mr.sample_fused
    monkeypatch.setattr(mr, "sample_fused", lambda x, p, *a: calls.append(len(p)) or real(x, p, *a))
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", async_scheduling="on")
    prompts = [[5, 17, 40, 9], [200, 3, 77], [8, 8, 8, 8, 8, 31]]
    kw = dict(max_tokens=6, ignore_eos=True)
    greedy = SamplingParams(temperature=0, **kw)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls == []  # all greedy: the argmax alone
    top1 = SamplingParams(temperature=0.9, top_k=1, **kw)  # keeps only the most likely token
    nucleus = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, **kw)
    outs = llm.generate(prompts, [greedy, top1, nucleus], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert calls and max(calls) == 3  # prefill's and decode's steps, one call each
    assert got[0] == want[0] and got[1] == want[1]
    vocab = llm.core.runner.vocab_size
    assert len(got[2]) == 6 and all(0 <= t < vocab for t in got[2])
    # a seeded request draws the same tokens alone and in a batch (its noise follows from its
    # seed and positions), and another seed draws others
    seeded = SamplingParams(temperature=1.0, seed=3, **kw)
    alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts[::-1], [nucleus, top1, seeded], use_tqdm=False)  # 3rd: prompt 0
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4, **kw)
    assert llm.generate(prompts[:1], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    # what the kernel does not do sends the whole batch to the sorting sampler
    calls.clear()
    for other in (
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, **kw),
        SamplingParams(temperature=0.8, logprobs=1, **kw),
        SamplingParams(temperature=0.8, presence_penalty=0.5, **kw),
    ):
        llm.generate(prompts[:2], [nucleus, other], use_tqdm=False)
    assert calls == []


def test_two_engines_in_one_process_follow_their_own_switch(tiny_models, monkeypatch) -> None:
    """``KernelConfig.fused_sampler`` belongs to each engine: two engines in one process, one
    with the sort-free sampler off, sample the same batch on different paths, in turn."""
    import fulcrum.worker.step_sampling as mr

    monkeypatch.setattr(mr, "use_triton", lambda *a: True)  # the CUDA path, interpreted
    fused_rows: list[int] = []
    real = mr.sample_fused
    monkeypatch.setattr(
        mr, "sample_fused", lambda x, p, *a: fused_rows.append(len(p)) or real(x, p, *a)
    )
    kw = dict(device="cpu", dtype="float32", kv_cache_memory=0.05)
    on = LLM(tiny_models["llama"], **kw)
    off = LLM(tiny_models["llama"], kernel_config={"fused_sampler": False}, **kw)
    assert on.core.runner.kernel_config.fused_sampler
    assert not off.core.runner.kernel_config.fused_sampler
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=2, ignore_eos=True)
    prompts = [[5, 17, 40, 9], [200, 3, 77]]
    for llm, takes_kernel in ((off, False), (on, True), (off, False)):
        fused_rows.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
        assert bool(fused_rows) == takes_kernel, (llm is on, fused_rows)
    # the runner's one switch-over point hands a new config to everything that holds one
    from fulcrum.kernels.dispatch import Configured

    runner = off.core.runner
    swapped = runner.kernel_config.replace(fused_sampler=True, gemv={"max_m": 2})
    runner.set_kernel_config(swapped)
    holders = [m for m in runner.model.modules() if isinstance(m, Configured)]
    assert len(holders) > 10 and all(m.kernel_config is swapped for m in holders)
    assert runner.attn_backend.kernel_config is swapped
    assert runner.config.kernel_config is swapped
    fused_rows.clear()
    off.generate(prompts, sp, use_tqdm=False)
    assert fused_rows  # now it takes the kernel
    assert on.core.runner.kernel_config.gemv.max_m == 1  # the other engine is untouched


@pytest.mark.parametrize("params", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2, seed=1)])
def test_fused_eligibility_follows_the_params(params) -> None:
    from fulcrum.protocol import to_wire
    from fulcrum.worker.sampler import fused_sampling

    assert fused_sampling(to_wire(SamplingParams(temperature=0.7, **params), 8))
    assert not fused_sampling(to_wire(SamplingParams(temperature=0.7, logprobs=1, **params), 8))
