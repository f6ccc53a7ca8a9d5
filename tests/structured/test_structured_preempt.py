"""Grammar matchers through preemption and n > 1: a constrained request preempted (blocks freed,
recomputed later) keeps its matcher in step with its kept output, so greedy output equals an
unpreempted run token for token and stays valid; n > 1 sequences each get their own matcher."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


def _run(llm: LLM, n: int, temperature: float) -> list:
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Describe item {i} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
    sp = SamplingParams(
        temperature=temperature, seed=5, max_tokens=40, structured_outputs=SO(json=SCHEMA)
    )
    return llm.generate(prompts, sp, use_tqdm=False)


@pytest.fixture(scope="module")
def tight() -> LLM:
    # Too few blocks for six sequences at once: the newest ones are preempted and recomputed.
    return LLM(device="cpu", dtype="float32", num_kv_blocks=20, async_scheduling="on")


def test_preempted_grammar_output_equals_unpreempted(tight: LLM) -> None:
    roomy = LLM(device="cpu", dtype="float32", kv_cache_memory=0.1, async_scheduling="on")
    want = [o.outputs[0].token_ids for o in _run(roomy, 6, 0.0)]
    assert roomy.core.scheduler.num_preemptions == 0
    got = _run(tight, 6, 0.0)
    assert tight.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


def test_n_sampled_sequences_each_valid(tight: LLM) -> None:
    tok = tight.get_tokenizer()
    p = tok.apply_chat_template(
        [{"role": "user", "content": "An item as JSON."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = tight.generate(
        [p],
        SamplingParams(
            temperature=1.0, seed=9, n=4, max_tokens=40, structured_outputs=SO(json=SCHEMA)
        ),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs]
    for c in out.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert c.text.startswith("{")
    assert sum(c.finish_reason == "stop" for c in out.outputs) >= 2, texts
