"""The draft_model method's own cases (test_spec_decode_lossless.py runs the shared ones with a
noised draft and the target as its own draft): greedy tokens equal the plain engine for drafts
of every quality, with the acceptance each should have, also from prefix-cache hits; sampled
runs reproduce under a seed, and a draft equal to the target keeps its sampled guesses; the
embedded model as its own draft on a copy task with a stop string."""

from __future__ import annotations

import pytest

from fulcrum import LLM, SamplingParams
from spec_helpers import check_idle as _check_idle
from spec_helpers import draft_spec, make_drafts
from spec_helpers import spec_prompts as _prompts
from spec_helpers import toks as _toks

KW = {"device": "cpu", "dtype": "float32", "block_size": 4}


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    return make_drafts(tiny_models["llama"], tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="module")
def base(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], **KW)


@pytest.fixture(scope="module")
def noisy(tiny_models, drafts) -> LLM:
    return LLM(tiny_models["llama"], speculative_config=draft_spec(drafts["noisy"]), **KW)


@pytest.mark.parametrize("which", ["self", "noisy", "small"])
def test_greedy_identical_with_prefix_hits(tiny_models, drafts, base, which):
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_models["llama"], speculative_config=draft_spec(drafts[which], k=3), **KW)
    assert _toks(llm.generate(prompts, sp, use_tqdm=False)) == ref
    stats = llm.core.scheduler.spec_stats
    assert stats.num_drafts > 0 and sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    if which == "self":  # the target as its own draft: every guess is kept
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if which == "noisy":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    _check_idle(llm)
    again = llm.generate(prompts, sp, use_tqdm=False)  # the prefix cache serves the prompts
    assert _toks(again) == ref and any(o.num_cached_tokens > 0 for o in again)
    if which == "self":  # the cached blocks hold the draft's KV too: guesses still all kept
        assert llm.core.scheduler.spec_stats.num_accepted_tokens == (
            llm.core.scheduler.spec_stats.num_draft_tokens
        )
    _check_idle(llm)


def test_sampled_seeded_reproducible_and_self_draft_accepts(tiny_models, drafts, noisy):
    prompts = _prompts(4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    first = _toks(noisy.generate(prompts, sp, use_tqdm=False))
    assert first == _toks(noisy.generate(prompts, sp, use_tqdm=False))
    # the target as its own draft: q equals p (up to rounding), so sampled guesses are kept
    llm = LLM(tiny_models["llama"], speculative_config=draft_spec(drafts["self"]), **KW)
    mixed = [sp, SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True)]
    for params in mixed:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(c.token_ids) == 16 for o in outs for c in o.outputs)
    stats = llm.core.scheduler.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0, stats
    _check_idle(llm)


COPY = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)


def test_smollm2_as_its_own_draft_copy_task_and_stop_string(smollm_dir, smollm_tokenizer):
    """The embedded model drafting for itself: all guesses kept, the text and tokens of the
    plain engine, and a stop string inside an accepted run cuts the same text."""
    msgs = [{"role": "user", "content": "Repeat this code exactly:\n" + COPY}]
    prompt = smollm_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    params = (
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24, stop=["width"]),
    )
    plain = LLM(smollm_dir, device="cpu", dtype="float32")
    wants = [plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0] for sp in params]
    del plain
    assert wants[1].finish_reason == "stop"
    fast = LLM(smollm_dir, device="cpu", dtype="float32", speculative_config=draft_spec(smollm_dir))
    for sp, want in zip(params, wants, strict=True):
        got = fast.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert got.text == want.text and list(got.token_ids) == list(want.token_ids)
        assert got.finish_reason == want.finish_reason
    stats = fast.core.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats


def test_emulated_draft_graphs_match(tiny_models, drafts):
    """The draft's one-token passes through the decode-graph machinery (replays emulated off
    CUDA, the triton backend in the interpreter): the same tokens, the same acceptance."""
    from fulcrum.worker.draft_graphs import capture_draft_graphs

    prompts = _prompts(6)[2:5]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4)
    spec = draft_spec(drafts["noisy"], k=3)
    eager = LLM(tiny_models["llama"], speculative_config=spec, **kw)
    want = _toks(eager.generate(prompts, sp, use_tqdm=False))
    assert want == _toks(LLM(tiny_models["llama"], **kw).generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_models["llama"], speculative_config=spec, **kw)
    capture_draft_graphs(llm.core.runner, emulate=True)
    graphs = llm.core.runner.draft.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert _toks(llm.generate(prompts, sp, use_tqdm=False)) == want
    assert graphs.num_replays > 0
    a, b = eager.core.scheduler.spec_stats, llm.core.scheduler.spec_stats
    assert (a.num_draft_tokens, a.num_accepted_tokens) == (
        b.num_draft_tokens,
        b.num_accepted_tokens,
    )
    _check_idle(llm)
