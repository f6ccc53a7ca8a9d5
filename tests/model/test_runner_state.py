"""The runner's own per-request state, kept from the scheduler's outputs alone: seeded draws
continue across preemption, and finished requests leave nothing behind."""

from __future__ import annotations

from fulcrum import LLM, SamplingParams

PROMPTS = [[5, 17, 40, 9, 11, 3], [200, 3, 77, 5, 6], [8, 8, 8, 8, 8, 31, 2], [90, 91, 92, 93]]


def _sampled(llm: LLM) -> list[list[int]]:
    # penalties keep the whole output history in play; seeds make each draw reproducible
    params = [
        SamplingParams(temperature=1.0, seed=10 + i, presence_penalty=0.5, max_tokens=14,
                       ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_survives_preemption(tiny_models):
    kw = dict(dtype="float32", device="cpu")
    want = _sampled(LLM(tiny_models["llama"], **kw))
    llm = LLM(tiny_models["llama"], num_kv_blocks=12, block_size=4, **kw)
    assert _sampled(llm) == want
    assert llm.stats()["num_preemptions_total"] > 0
    llm.core.step()  # an empty step still tells the runner who finished
    assert not llm.core.runner.inputs._states
