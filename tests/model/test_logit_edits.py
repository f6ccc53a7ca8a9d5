"""``logit_bias`` and ``allowed_token_ids`` through the engine (tiny Llama, CPU float32): greedy
tokens equal transformers' generate under the same edits (its ``sequence_bias`` and
``prefix_allowed_tokens_fn``), batched with plain requests; a +100 bias forces its token and an
allowed list holds every draw under every sampler; speculative decoding (n-gram guesses, a
draft model) keeps the edited greedy tokens."""

from __future__ import annotations

import random

import pytest

from fulcrum import LLM, SamplingParams
from model_factory import hf_greedy
from spec_helpers import draft_spec, make_drafts, spec_prompts, toks

MAX_NEW = 12
KW = {"device": "cpu", "dtype": "float32", "block_size": 4}


def _biases(reference: list[list[int]]) -> list[dict[int, float] | None]:
    """Per prompt: none; a ban of the token greedy picks first; a mix of small biases on the
    tokens greedy picks (they reorder close logits without fixing the output); none; a ban
    of every token of the unbiased output."""
    rng = random.Random(3)
    mixed = {t: rng.choice([-2.5, -0.7, 0.4, 1.5]) for t in set(reference[2])}
    return [None, {reference[1][0]: -100.0}, mixed, None, {t: -100.0 for t in reference[4]}]


@pytest.fixture(scope="module")
def case(tiny_models):
    prompts = spec_prompts(1)[:5]
    plain = hf_greedy(tiny_models["llama"], prompts, MAX_NEW)
    biases = _biases(plain)
    ref = []
    for p, b in zip(prompts, biases, strict=True):
        kw = {"sequence_bias": {(t,): v for t, v in b.items()}} if b else {}
        ref += hf_greedy(tiny_models["llama"], [p], MAX_NEW, **kw)
    assert ref[1] != plain[1] and ref[4] != plain[4]  # the bias changed what greedy picks
    assert not set(ref[4]) & set(plain[4])
    return prompts, biases, ref


def _params(biases) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias=b) for b in biases]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_greedy_matches_transformers_in_a_mixed_batch(tiny_models, case, async_scheduling):
    prompts, biases, ref = case
    llm = LLM(tiny_models["llama"], async_scheduling=async_scheduling, **KW)
    assert toks(llm.generate(prompts, _params(biases), use_tqdm=False)) == ref


def test_speculative_decoding_keeps_the_biased_tokens(tiny_models, case, tmp_path_factory):
    prompts, biases, ref = case
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}  # fmt: skip
    drafts = make_drafts(tiny_models["llama"], tmp_path_factory.mktemp("drafts"))
    for spec in (ngram, draft_spec(drafts["noisy"], k=3)):
        llm = LLM(tiny_models["llama"], speculative_config=spec, **KW)
        assert toks(llm.generate(prompts, _params(biases), use_tqdm=False)) == ref
        assert llm.core.scheduler.spec_stats.num_drafts > 0


def test_plus_100_forces_its_token_under_every_sampler(tiny_models, case):
    prompts = case[0][:4]
    llm = LLM(tiny_models["llama"], **KW)
    samplers = [
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1, logit_bias={77: 100}),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=6, ignore_eos=True, logit_bias={78: 100}),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=6, ignore_eos=True, logprobs=2,
                       logit_bias={79: 100}),  # the sorting sampler
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                       logit_bias={80: 100}),  # penalties: one step at a time
    ]
    outs = llm.generate(prompts, samplers, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[77 + i] * 6 for i in range(4)]


def test_out_of_vocabulary_id_is_rejected(tiny_models):
    llm = LLM(tiny_models["llama"], **KW)
    with pytest.raises(ValueError, match="logit_bias: token id 320 is outside"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={320: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 400 is outside"):
        llm.generate([[5, 6, 7]], SamplingParams(allowed_token_ids=[3, 400]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


ALLOWED = [11, 40, 41, 97, 150, 151, 152, 300]


def test_allowed_token_ids_greedy_matches_transformers(tiny_models, case):
    prompts = case[0][:4]
    ref = [
        hf_greedy(tiny_models["llama"], [p], MAX_NEW,
                  prefix_allowed_tokens_fn=lambda batch, ids: ALLOWED)[0]  # fmt: skip
        if i % 2 else plain
        for i, (p, plain) in enumerate(zip(prompts, hf_greedy(tiny_models["llama"], prompts, MAX_NEW), strict=True))
    ]  # fmt: skip
    llm = LLM(tiny_models["llama"], **KW)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW,
                             allowed_token_ids=ALLOWED if i % 2 else None) for i in range(4)]  # fmt: skip
    assert toks(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert set(ref[1]) <= set(ALLOWED)


def test_allowed_token_ids_hold_every_sampler(tiny_models, case):
    prompts = case[0][:3]
    llm = LLM(tiny_models["llama"], **KW)
    kw = dict(max_tokens=24, ignore_eos=True, allowed_token_ids=ALLOWED)
    samplers = [
        SamplingParams(temperature=1.5, seed=2, **kw),
        SamplingParams(temperature=1.0, top_k=3, logprobs=2, **kw),
        SamplingParams(temperature=1.0, frequency_penalty=1.0, logit_bias={40: -5.0}, **kw),
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, samplers, use_tqdm=False)]
    assert all(set(o.token_ids) <= set(ALLOWED) for o in outs)
    assert len(set(outs[0].token_ids)) > 2  # drawn among them, not stuck on one
    # the logprobs are those of the restricted distribution: all mass on the allowed ids
    assert all(set(lp) <= set(ALLOWED) for lp in outs[1].logprobs)


def test_bad_words_match_transformers_and_hold_under_speculation(tiny_models):
    """``bad_words`` (as token ids, what the frontend's tokenizer makes of them): a one-token
    word never drawn, a two-token word's last token banned right after its first; greedy
    tokens equal transformers' ``bad_words_ids`` (the words chosen inside the output, so that
    both read the same history), with asynchronous scheduling asked for and with n-gram
    speculation (such a request makes no guesses)."""
    prompts = spec_prompts(2)[:3]
    plain = hf_greedy(tiny_models["llama"], prompts, MAX_NEW)
    words = [[[plain[0][1]]], [[plain[1][3], plain[1][4]]], None]  # per prompt
    assert prompts[1][-1] != plain[1][3]  # the two-token word does not start in the prompt
    ref = []
    for p, w in zip(prompts, words, strict=True):
        ref += hf_greedy(tiny_models["llama"], [p], MAX_NEW, **({"bad_words_ids": w} if w else {}))
    assert ref[0] != plain[0] and ref[1] != plain[1] and ref[2] == plain[2]

    def params() -> list[SamplingParams]:
        out = []
        for w in words:
            sp = SamplingParams(temperature=0, max_tokens=MAX_NEW)
            sp.bad_words_token_ids = w or []
            out.append(sp)
        return out

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1}  # fmt: skip
    for extra in ({"async_scheduling": "on"}, {"speculative_config": ngram}):
        llm = LLM(tiny_models["llama"], **KW, **extra)
        assert toks(llm.generate(prompts, params(), use_tqdm=False)) == ref, extra
