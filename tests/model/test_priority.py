"""Per-request scheduling and prompt options through the offline API (tiny Llama, CPU): with one
seat, requests run in priority order (lower first), not in submission order; a truncated prompt
is its last tokens."""

from __future__ import annotations

import pytest

from fulcrum import LLM, SamplingParams


def test_one_seat_serves_lower_values_first(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", max_num_seqs=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False, priority=[2, 0, 1])
    finished = sorted(range(3), key=lambda i: outs[i].metrics.finished_time)
    assert finished == [1, 2, 0]
    # the outputs themselves do not depend on the order
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)
    ]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts, sp, use_tqdm=False, priority=[0, 1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32")
    long = [(7 * i) % 300 + 3 for i in range(60)]
    sp = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate([long], SamplingParams(truncate_prompt_tokens=12, **sp), use_tqdm=False)[0]
    tail = llm.generate([long[-12:]], SamplingParams(**sp), use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-12:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    short = llm.generate([long[:5]], SamplingParams(truncate_prompt_tokens=12, **sp), use_tqdm=False)
    assert short[0].prompt_token_ids == long[:5]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
