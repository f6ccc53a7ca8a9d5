"""Speculative decoding is lossless: greedy tokens equal the engine without speculation (and
Hugging Face), across chunked prefill, prefix-cache hits, preemption, n > 1, stop strings and
ids, max_tokens inside an accepted run, min_tokens and logprobs; seeded sampling reproduces.
Methods: ngram, suffix, and draft_model with a noised copy of the target (some guesses kept) and
with the target itself (all kept)."""

from __future__ import annotations

import pytest

from fulcrum import LLM, SamplingParams
from model_factory import hf_greedy
from spec_helpers import check_idle as _check_idle
from spec_helpers import draft_spec, make_drafts
from spec_helpers import spec_prompts as _prompts
from spec_helpers import toks as _toks

SPECS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
    "draft_noisy": "noisy",  # draft_model: the draft made by the ``drafts`` fixture
    "draft_self": "self",
}
KW = {"device": "cpu", "dtype": "float32", "block_size": 4}


@pytest.fixture(scope="module")
def base(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], **KW)


@pytest.fixture(scope="session")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    return make_drafts(tiny_models["llama"], tmp_path_factory.mktemp("drafts"))


def _config(name: str, drafts: dict[str, str]) -> dict:
    spec = SPECS[name]
    return draft_spec(drafts[spec]) if isinstance(spec, str) else spec


@pytest.fixture(scope="module", params=list(SPECS))
def spec(request, tiny_models, drafts) -> LLM:
    return LLM(tiny_models["llama"], speculative_config=_config(request.param, drafts), **KW)


def test_greedy_matches_hf_and_accepts(tiny_models, base, spec):
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = hf_greedy(tiny_models["llama"], prompts, 24)
    assert _toks(base.generate(prompts, sp, use_tqdm=False)) == ref
    before = spec.stats()
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert _toks(got) == ref
    stats = spec.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert before is not None
    _check_idle(spec)
    # Second pass: the prefix cache serves the prompts; the tokens stay the same.
    again = spec.generate(prompts, sp, use_tqdm=False)
    assert _toks(again) == ref
    assert any(o.num_cached_tokens > 0 for o in again)
    _check_idle(spec)


@pytest.mark.parametrize(("method", "blocks"), [("ngram", 24), ("draft_noisy", 14)])
def test_chunked_prefill_small_budget_and_preemption(tiny_models, drafts, base, method, blocks):
    prompts = _prompts(1)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    llm = LLM(
        tiny_models["llama"],
        speculative_config=_config(method, drafts),
        max_num_batched_tokens=7,
        num_kv_blocks=blocks,
        **KW,
    )
    assert _toks(llm.generate(prompts, sp, use_tqdm=False)) == ref
    sched = llm.core.scheduler
    assert sched.num_preemptions > 0 and sched.spec_stats.num_drafts > 0
    _check_idle(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_accepted_run(base, spec, max_tokens):
    prompts = _prompts(2)[:4]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert _toks(got) == ref
    assert all(len(c.token_ids) == max_tokens for o in got for c in o.outputs)


def test_stop_ids_min_tokens_n_and_logprobs(base, spec):
    prompts = _prompts(3)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _toks(base.generate(prompts, plain, use_tqdm=False))
    # a stop id that occurs inside the output: the sequence ends there
    stop = ref[0][5]
    cases = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], min_tokens=8
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2),
    ]
    for sp in cases:
        assert _toks(spec.generate(prompts, sp, use_tqdm=False)) == _toks(
            base.generate(prompts, sp, use_tqdm=False)
        )
    lp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = base.generate(prompts, lp, use_tqdm=False)
    got = spec.generate(prompts, lp, use_tqdm=False)
    assert _toks(got) == _toks(want)
    for w, g in zip(want, got, strict=True):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(wl) == len(gl) == len(w.outputs[0].token_ids)
        for a, b in zip(wl, gl, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    _check_idle(spec)


def test_seeded_sampling_reproducible(tiny_models):
    llm = LLM(tiny_models["llama"], speculative_config=SPECS["ngram"], **KW)
    prompts = _prompts(4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    first = _toks(llm.generate(prompts, sp, use_tqdm=False))
    again = _toks(llm.generate(prompts, sp, use_tqdm=False))
    assert first == again
    assert llm.core.scheduler.spec_stats.num_drafts > 0


def test_async_scheduling_on(tiny_models, base):
    """With asynchronous scheduling asked for, steps with guesses run one at a time."""
    prompts = _prompts(5)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_models["llama"], speculative_config=SPECS["suffix"], async_scheduling="on", **KW)
    assert _toks(llm.generate(prompts, sp, use_tqdm=False)) == ref
    assert llm.core.scheduler.spec_stats.num_drafts > 0
    _check_idle(llm)


def test_async_overlap_past_disable_by_batch_size(tiny_models, base):
    """Past ``disable_by_batch_size`` no request guesses, so steps overlap; once the batch
    shrinks to it, steps run one at a time again and guesses resume. Tokens stay the same."""
    prompts = _prompts(7)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in (28, 24, 6, 6, 5, 5, 4)
    ]
    ref = _toks(base.generate(prompts, params, use_tqdm=False))
    spec = {**SPECS["ngram"], "disable_by_batch_size": 2}
    llm = LLM(tiny_models["llama"], speculative_config=spec, async_scheduling="on", **KW)
    assert _toks(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.core.num_overlapped_steps > 0  # while more than two requests ran
    assert llm.core.scheduler.spec_stats.num_drafts > 0  # once two or fewer were left
    _check_idle(llm)


COPY_TEXT = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)


SMOL_PARAMS = (
    SamplingParams(temperature=0, max_tokens=32),
    SamplingParams(temperature=0, max_tokens=32, stop=["perimeter"]),
)


@pytest.fixture(scope="module")
def smol_case(smollm_dir, smollm_tokenizer):
    """The embedded chat model asked to copy code, and its answers without speculation."""
    msgs = [{"role": "user", "content": "Repeat this code exactly:\n" + COPY_TEXT}]
    prompt = smollm_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    plain = LLM(smollm_dir, device="cpu", dtype="float32")
    return prompt, [
        plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0] for sp in SMOL_PARAMS
    ]


@pytest.mark.parametrize("method", ["ngram", pytest.param("suffix", marks=pytest.mark.slow)])
def test_smollm2_copy_task_and_stop_string(smollm_dir, smol_case, method):
    """Guesses are accepted, text and tokens are the same as without speculation, and a stop
    string inside an accepted run cuts the same text."""
    prompt, wants = smol_case
    assert wants[1].finish_reason == "stop"  # the stop string occurs in the answer
    fast = LLM(smollm_dir, device="cpu", dtype="float32", speculative_config=SPECS[method])
    for sp, want in zip(SMOL_PARAMS, wants, strict=True):
        got = fast.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert got.text == want.text and list(got.token_ids) == list(want.token_ids)
        assert got.finish_reason == want.finish_reason
    stats = fast.core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.5, stats


def test_verify_steps_replay_the_decode_graphs(tiny_models):
    """Verify steps of decoding requests run as decode rows (last token, then each guess)
    through the decode graphs (replays emulated off CUDA, the triton backend in the
    interpreter): the tokens, logprobs, seeded draws and acceptance of the eager verify step."""
    from fulcrum.worker.startup import capture_graphs

    prompts = _prompts(2)[:2] + _prompts(2)[5:6]
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=2)
    spec = {**SPECS["ngram"], "num_speculative_tokens": 3}
    cases = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=3, ignore_eos=True),
    ]
    eager = LLM(tiny_models["llama"], speculative_config=spec, **kw)
    llm = LLM(tiny_models["llama"], speculative_config=spec, **kw)
    runner = llm.core.runner
    capture_graphs(runner, emulate=True)
    assert runner.graphs.sizes == [1, 2, 4, 8]  # 2 requests x (1 + 3) verify rows
    for sp in cases:
        want = eager.generate(prompts, sp, use_tqdm=False)
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert _toks(got) == _toks(want)
        for w, g in zip(want, got, strict=True):
            for a, b in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or [], strict=True):
                assert a.keys() == b.keys()
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert runner.num_graph_verify_steps > 0
    a, b = eager.core.scheduler.spec_stats, llm.core.scheduler.spec_stats
    assert (a.num_draft_tokens, a.num_accepted_tokens) == (b.num_draft_tokens, b.num_accepted_tokens)
    _check_idle(llm)
