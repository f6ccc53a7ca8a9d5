"""Speculative decoding on CUDA: verify steps through the piecewise graphs (and eagerly) give the
tokens of the engine without speculation (decode graphs, asynchronous scheduling).

float32: token for token. bfloat16: the project's rule (at the first differing position each
side's token is among the other's top 5), and at least half the sequences identical.
"""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum import LLM, SamplingParams  # noqa: E402
from model_factory import assert_first_divergence_in_top, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

TOP = 5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        unit = torch.randint(5, 320, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        out.append(unit.tolist() * (3 + i % 4))  # repetitive: the proposers find matches
    return out


def _run(llm: LLM, prompts: list[list[int]], logprobs: int | None):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    tops = [
        [[t for t, lp in d.items() if lp.rank <= TOP] for d in (o.outputs[0].logprobs or [])]
        for o in outs
    ]
    return tokens, tops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("eager", [False, True])
def test_verify_steps_match_plain_engine(tiny_llama: str, dtype: str, method: str, eager: bool):
    kw = dict(
        device="cuda",
        dtype=dtype,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_kv_blocks=512,
        enforce_eager=eager,
    )
    prompts = _prompts(12, seed=3)
    logprobs = None if dtype == "float32" else TOP
    plain = LLM(tiny_llama, **kw)
    ref, ref_top = _run(plain, prompts, logprobs)
    del plain
    gc.collect()
    spec = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    got, got_top = _run(llm, prompts, logprobs)
    stats = llm.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if dtype == "float32":
        assert got == ref
    else:
        for i in range(len(prompts)):
            assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"request {i}")
        same = sum(a == b for a, b in zip(got, ref, strict=True))
        assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} sequences identical"
    llm.core.scheduler.kv.check_integrity()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_seeded_sampling_reproducible_on_cuda(tiny_llama: str):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(tiny_llama, device="cuda", speculative_config=spec, num_kv_blocks=512)
    prompts = _prompts(6, seed=4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=11, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert first == again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True])
def test_draft_model_matches_plain_engine(tiny_llama: str, dtype: str, eager: bool):
    """The target as its own draft (every greedy guess kept in float32): the plain engine's
    tokens, the draft's one-token passes through its decode graphs unless eager."""
    kw = dict(
        device="cuda", dtype=dtype, max_num_seqs=16, max_num_batched_tokens=256,
        num_kv_blocks=512, enforce_eager=eager,
    )  # fmt: skip
    prompts = _prompts(12, seed=5)
    logprobs = None if dtype == "float32" else TOP
    plain = LLM(tiny_llama, **kw)
    ref, ref_top = _run(plain, prompts, logprobs)
    del plain
    gc.collect()
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 4}
    llm = LLM(tiny_llama, speculative_config=spec, **kw)
    got, got_top = _run(llm, prompts, logprobs)
    stats = llm.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert (llm.core.runner.draft.graphs is None) == eager
    if dtype == "float32":
        assert got == ref
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        for i in range(len(prompts)):
            assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"request {i}")
    # seeded sampling reproduces
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert first == again
    llm.core.scheduler.kv.check_integrity()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
