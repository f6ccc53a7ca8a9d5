"""Sampling through the whole engine on the embedded model: seeds, n, logprobs, stops."""

from __future__ import annotations

import pytest

from fulcrum import LLM, SamplingParams


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(request):
    return LLM(device="cpu", dtype="float32", kv_cache_memory=0.25, async_scheduling=request.param)


PROMPTS = ["Tell me a story about a dragon.", "List three fruits:", "Why is the sky blue?"]


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20)
    batch = llm.generate(PROMPTS[1:] + [PROMPTS[0]], [others, others, sp], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    different = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=99,
                                                          max_tokens=16), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_n_outputs_and_logprobs(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=20)
    out = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in entry and len(entry) in (20, 21)
            assert all(v.logprob <= 0.0 for v in entry.values())
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-4)


def test_stop_string_excluded_and_stop_token(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0]
    # Pick a stop string from the middle of the greedy text (spanning tokens where possible).
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    tok = full.token_ids[3]
    by_id = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40,
                                                    stop_token_ids=[tok]), use_tqdm=False)[0]
    out = by_id.outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok
    assert len(out.token_ids) == full.token_ids.index(tok) + 1


def test_length_and_ignore_eos(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5
    long = llm.chat([{"role": "user", "content": "Say hi."}],
                    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert len(long[0].outputs[0].token_ids) == 60


def test_penalties_and_min_tokens_mixed_with_plain_requests(llm):
    """Requests whose sampling needs their own history (penalties, min_tokens) make the core run
    one step at a time; batched with plain ones, every output equals the request run alone."""
    special = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=24, frequency_penalty=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10),
    ]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [llm.generate(PROMPTS[i], sp, use_tqdm=False)[0].outputs[0].token_ids
             for i, sp in enumerate(special)]
    batch = llm.generate(PROMPTS + PROMPTS, special + [plain] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch[:3]] == alone
    assert len(batch[2].outputs[0].token_ids) >= 10
    plain_alone = [llm.generate(p, plain, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in batch[3:]] == plain_alone


def test_request_metrics_are_ordered(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    m = out.metrics
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time


def _scored(llm, ids: list[int], k: int):
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].prompt_logprobs


def test_prompt_logprobs_score_what_generation_sampled(llm):
    """Scoring a text (``prompt_logprobs``, what evaluation harnesses ask) gives each token the
    logprob, rank and alternatives it had when the model generated it; the first prompt token
    has none. Scored again, the prompt is in the prefix cache, and is computed anyway."""
    gen = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, logprobs=3),
                       use_tqdm=False)[0]  # fmt: skip
    c, n = gen.outputs[0], len(gen.prompt_token_ids)
    ids = gen.prompt_token_ids + c.token_ids
    plp = _scored(llm, ids, 3)
    assert len(plp) == len(ids) and plp[0] is None and all(e is not None for e in plp[1:])
    for i, tok in enumerate(c.token_ids):
        got, want = plp[n + i], c.logprobs[i]
        assert got[tok].rank == want[tok].rank == 1
        assert got[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)
        assert set(got) == set(want)
    for entry, tok in zip(plp[1:], ids[1:], strict=True):
        assert tok in entry and entry[tok].logprob <= 0.0 and len(entry) in (3, 4)
    again = _scored(llm, ids, 0)
    assert [e[t].logprob for e, t in zip(again[1:], ids[1:], strict=True)] == pytest.approx(
        [e[t].logprob for e, t in zip(plp[1:], ids[1:], strict=True)], abs=1e-5)
    assert all(len(e) == 1 for e in again[1:])  # k = 0: the prompt token alone


def test_prompt_logprobs_across_prefill_chunks():
    """A prompt prefilled over several steps (a 16-token budget) scores as in one step."""
    small = LLM(device="cpu", dtype="float32", kv_cache_memory=0.25, max_num_batched_tokens=16)
    ids = small.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30),
                         use_tqdm=False)[0]  # fmt: skip
    ids = ids.prompt_token_ids + ids.outputs[0].token_ids
    chunked = _scored(small, ids, 2)
    whole = LLM(device="cpu", dtype="float32", kv_cache_memory=0.25)
    ref = _scored(whole, ids, 2)
    assert len(chunked) == len(ref) == len(ids)
    for a, b, tok in zip(chunked[1:], ref[1:], ids[1:], strict=True):
        assert a[tok].rank == b[tok].rank and set(a) == set(b)
        assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def test_prompt_logprobs_with_n(llm):
    """n sequences of one scored prompt: the request carries the prompt's logprobs once."""
    ids = llm.get_tokenizer()(PROMPTS[1])["input_ids"]
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    assert all(tok in e for e, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True))
