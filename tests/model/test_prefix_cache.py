"""Radix prefix cache end to end: same tokens with the cache on and off, reuse, isolation."""

from __future__ import annotations

import random

import pytest

from fulcrum import LLM, SamplingParams
from model_factory import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _workloads(rng: random.Random, vocab: int):
    sys_a = [rng.randrange(3, vocab) for _ in range(70)]
    sys_b = [rng.randrange(3, vocab) for _ in range(45)]
    shared = [sys_a + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    shared += [sys_b + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    partial = [sys_a[: rng.randrange(10, 70)] + [rng.randrange(3, vocab)] for _ in range(4)]
    return shared, partial


# gemma2/gemma3: sliding windows (8 tokens) over reused prefixes. Not phi3: these prompts
# pass its tiny LongRoPE pretraining length, where transformers' generate switches a whole
# prompt to the long factors and fulcrum switches per position (test_longrope.py).
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_cache_on_off_identical_tiny(tiny_models, arch):
    rng = random.Random(3)
    shared, partial = _workloads(rng, 320)
    prompts = shared + partial
    ref = hf_greedy(tiny_models[arch], prompts, 12)
    on = LLM(tiny_models[arch], device="cpu", dtype="float32", block_size=4)
    off = LLM(tiny_models[arch], device="cpu", dtype="float32", block_size=4, enable_prefix_caching=False)
    assert _tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert _tokens(off.generate(prompts, GREEDY, use_tqdm=False)) == ref
    overlapped = LLM(tiny_models[arch], device="cpu", dtype="float32", block_size=4, async_scheduling="on")
    assert _tokens(overlapped.generate(prompts + prompts, GREEDY, use_tqdm=False)) == ref + ref
    overlapped.core.scheduler.kv.check_integrity()
    # Second pass: everything is cached now, one at a time and all together.
    again = on.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(again) == ref
    assert all(o.num_cached_tokens > 0 for o in again)
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0
    on.core.scheduler.kv.check_integrity()
    # Idle: every block is free or cached-evictable.
    kv = on.core.scheduler.kv
    assert kv.num_available == kv.num_blocks and kv.tree.protected_size == 0


def test_multi_turn_reuses_previous_turn(tiny_models):
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", block_size=4)
    rng = random.Random(5)
    conv = [rng.randrange(3, 320) for _ in range(40)]
    ref_llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", block_size=4,
                  enable_prefix_caching=False)
    prev_len = 0
    for turn in range(3):
        out = llm.generate([conv], GREEDY, use_tqdm=False)[0]
        ref = ref_llm.generate([conv], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        if turn:
            # The previous turn's prompt and answer are cached (whole blocks; the answer's last
            # token was sampled but never run through the model).
            assert out.num_cached_tokens >= (prev_len // 4) * 4 - 4
        conv = conv + out.outputs[0].token_ids + [rng.randrange(3, 320) for _ in range(7)]
        prev_len = len(conv) - 7


def test_salt_isolation_and_reuse(tiny_models):
    llm = LLM(tiny_models["mistral"], device="cpu", dtype="float32", block_size=4)
    p = list(range(10, 60))
    first = llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    other = llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)
    assert other[0].num_cached_tokens == 0  # never another tenant's blocks
    same = llm.generate([{"prompt_token_ids": p, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    assert same[0].num_cached_tokens == 48  # 49 tokens looked up, 12 whole blocks
    assert _tokens(first) == _tokens(other) == _tokens(same)


def test_600_token_shared_prefix_reports_cached_tokens(smollm_tokenizer):
    llm = LLM(device="cpu", dtype="float32", kv_cache_memory=0.25)
    text = " ".join(f"Rule {i}: be helpful, be precise and be kind." for i in range(60))
    prefix = smollm_tokenizer(text).input_ids[:600]
    assert len(prefix) == 600
    q1 = smollm_tokenizer(" Question: what is rule 3?").input_ids
    q2 = smollm_tokenizer(" Question: what is rule 7?").input_ids
    params = SamplingParams(temperature=0, max_tokens=4)
    a = llm.generate([prefix + q1], params, use_tqdm=False)[0]
    b = llm.generate([prefix + q2], params, use_tqdm=False)[0]
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens >= 600 // 16 * 16


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_host_tier_serves_evicted_prefixes(tiny_models, async_scheduling):
    """A device pool too small for every conversation's prefix, over a host tier: the prefixes
    evicted while others run are copied to host memory and back when their prompts return
    (multi-turn: each turn repeats the conversation so far); greedy tokens equal transformers'
    throughout (asynchronous scheduling with the LPM policy, which orders by either tier's
    match without copying), and the prompts found on the host count in the stats."""
    rng = random.Random(5)
    convs = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(4)]
    turns = [c + [rng.randrange(3, 320) for _ in range(6)] for c in convs]
    ref = hf_greedy(tiny_models["llama"], convs + turns, 12)
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", block_size=4, num_kv_blocks=32,
              max_num_seqs=2, host_kv_cache_memory=0.001, async_scheduling=async_scheduling,
              schedule_policy="lpm" if async_scheduling == "on" else "fcfs")  # fmt: skip
    assert llm.core.runner.num_host_blocks > 0
    out = _tokens(llm.generate(convs, GREEDY, use_tqdm=False))
    out += _tokens(llm.generate(turns, GREEDY, use_tqdm=False))
    assert out == ref
    stats = llm.stats()
    assert stats["prefix_cache_host_hits"] >= 4 * 36  # most of each conversation came back
    llm.core.scheduler.kv.check_integrity()
