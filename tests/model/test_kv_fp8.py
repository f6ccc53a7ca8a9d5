"""FP8 KV cache end to end on the embedded model: a quarter of float32's bytes per token, and
greedy outputs that stay within the full-precision run's top-5 where they first differ."""

from __future__ import annotations

import pytest
import torch

from fulcrum import LLM, SamplingParams
from model_factory import assert_first_divergence_in_top

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three fruits:",
    "Explain what a neural network is in one sentence.",
    "1, 2, 3, 4,",
    "Translate 'good morning' into Spanish.",
]
TOP = 5


def _run(llm: LLM, prompts, max_tokens: int = 24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    tops = [[[t for t, lp in d.items() if lp.rank <= TOP] for d in o.outputs[0].logprobs] for o in outs]
    return tokens, tops


def _check_close(ref: LLM, fp8: LLM, prompts, max_tokens: int) -> None:
    runner = fp8.core.runner
    assert runner.kv_dtype == torch.float8_e4m3fn
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert ref.core.runner.bytes_per_block == 4 * runner.bytes_per_block  # float32 -> fp8
    want, want_top = _run(ref, prompts, max_tokens)
    got, got_top = _run(fp8, prompts, max_tokens)
    for i in range(len(prompts)):
        assert len(got[i]) == max_tokens
        assert_first_divergence_in_top(got[i], got_top[i], want[i], want_top[i], f"prompt {i}")
    same = sum(a == b for a, b in zip(got, want, strict=True))
    assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} greedy outputs identical"


def test_fp8_kv_cache_close_to_full_precision():
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=0.25)
    ref, fp8 = LLM(**kw), LLM(kv_cache_dtype="fp8", **kw)
    assert fp8.core.runner.num_blocks >= 4 * ref.core.runner.num_blocks - 4  # 4x the tokens
    _check_close(ref, fp8, PROMPTS, 24)


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(device="cpu", kv_cache_dtype="int4")
