"""Greedy tokens equal Hugging Face transformers (CPU, float32): batched, chunked, preempted."""

from __future__ import annotations

import random

import pytest

from fulcrum import LLM, SamplingParams
from model_factory import hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nx = np.",
    "Dear Sir or Madam,",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "A haiku about autumn:\n",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "SELECT name FROM users WHERE",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "Translate to French: Good morning ->",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def smol_prompts(smollm_tokenizer) -> list[list[int]]:
    return [smollm_tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def smol_reference(smollm_dir, smol_prompts) -> list[list[int]]:
    return hf_greedy(smollm_dir, smol_prompts, MAX_NEW)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smol_llm():
    return LLM(dtype="float32", device="cpu", kv_cache_memory=0.25)


def test_embedded_model_matches_hf(smol_llm, smol_prompts, smol_reference):
    assert len(smol_prompts) >= 16
    assert _greedy(smol_llm, smol_prompts) == smol_reference


def test_embedded_model_text_via_strings(smol_llm, smol_reference, smollm_tokenizer):
    outs = smol_llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False
    )
    for o, ref in zip(outs, smol_reference[:4], strict=True):
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == smollm_tokenizer.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_embedded_model_chunked_prefill_and_preemption(smol_prompts, smol_reference, async_scheduling):
    # 7-token chunks and a pool of 12 blocks: prompts are chunked and requests get preempted
    # (9 requests of up to 34 tokens against 192 slots; all 17 would mostly re-prefill).
    n = 9
    llm = LLM(
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=7,
        num_kv_blocks=12,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    assert _greedy(llm, smol_prompts[:n]) == smol_reference[:n]
    assert llm.stats()["num_preemptions_total"] > 0


def test_embedded_model_order_and_batch_composition(smol_llm, smol_prompts, smol_reference):
    rng = random.Random(0)
    order = list(range(len(smol_prompts)))
    rng.shuffle(order)
    # Two uneven batches in a shuffled order.
    first, second = order[:5], order[5:]
    got = {}
    for part in (second, first):
        for i, toks in zip(part, _greedy(smol_llm, [smol_prompts[i] for i in part]), strict=True):
            got[i] = toks
    assert [got[i] for i in range(len(smol_prompts))] == smol_reference


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "mistral", "granite", "olmo2", "smollm3"])
def test_tiny_models_match_hf(tiny_models, arch):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 60))] for _ in range(6)]
    ref = hf_greedy(tiny_models[arch], prompts, 16)
    for kwargs in (
        dict(),
        dict(max_num_batched_tokens=5),
        dict(num_kv_blocks=24, block_size=4, enable_prefix_caching=False),
        dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=6),
        # the next step scheduled before this one's tokens are back (inputs patched in)
        dict(async_scheduling="on"),
        dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=6, async_scheduling="on"),
    ):
        llm = LLM(tiny_models[arch], dtype="float32", device="cpu", **kwargs)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, kwargs
        if kwargs.get("num_kv_blocks"):
            assert llm.stats()["num_preemptions_total"] > 0, kwargs
        llm.core.scheduler.kv.check_integrity()


def test_granite_logprobs_carry_its_logit_scaling(tiny_models):
    """Granite divides its logits by ``logits_scaling`` (greedy cannot tell): the sampled
    token's logprob equals transformers' at the first and a later step."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_models["granite"]
    prompt = [7, 93, 250, 31, 8]
    llm = LLM(path, dtype="float32", device="cpu")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=0),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:2]])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i][tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)


def test_smollm3_window_on_its_nope_layers(tiny_models, tmp_path):
    """SmolLM3 with ``use_sliding_window``: the window applies to the layers without rotary
    only, which both sides derive from ``no_rope_layers`` (the saved ``layer_types`` dropped)."""
    from model_factory import edited_copy

    path = edited_copy(tiny_models["smollm3"], tmp_path / "w", use_sliding_window=True,
                       sliding_window=8, layer_types=None)  # fmt: skip
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    ref = hf_greedy(path, prompts, 16)
    assert ref != hf_greedy(tiny_models["smollm3"], prompts, 16)  # the window matters
    llm = LLM(path, dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
