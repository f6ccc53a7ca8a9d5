"""The draft_model method is lossless: greedy tokens equal the engine without speculation across
chunked prefill, prefix-cache hits, preemption, n > 1, stop ids and strings, max_tokens inside an
accepted run, min_tokens and logprobs; seeded sampling reproduces. Drafts: the target itself
(every guess accepted), the target with noised weights (some accepted) and a smaller random
model with the same vocabulary (almost none)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from fulcrum import LLM, SamplingParams

KW = {"device": "cpu", "dtype": "float32", "block_size": 4}


def _spec(draft: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        unit = [rng.randrange(3, 320) for _ in range(rng.randrange(3, 7))]
        out.append((unit * 6)[: rng.randrange(12, 30)])
    out += [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 25))] for _ in range(3)]
    return out


def _toks(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _check_idle(llm: LLM) -> None:
    kv = llm.core.scheduler.kv
    kv.check_integrity()
    assert kv.num_available == kv.num_blocks


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The target's own directory, a noised copy of it, and a smaller random Llama."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    target = tiny_models["llama"]
    root = tmp_path_factory.mktemp("drafts")
    noisy = root / "noisy"
    noisy.mkdir()
    g = torch.Generator().manual_seed(5)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(target)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(target, f)))
    noised = {n: w + 0.6 * w.std() * torch.randn(w.shape, generator=g) for n, w in weights.items()}
    save_file(noised, str(noisy / "model.safetensors"))
    with open(os.path.join(target, "config.json")) as fh:
        (noisy / "config.json").write_text(json.dumps(json.load(fh)))
    cfg = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "small"))
    return {"self": target, "noisy": str(noisy), "small": str(root / "small")}


@pytest.fixture(scope="module")
def base(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], **KW)


@pytest.fixture(scope="module")
def noisy(tiny_models, drafts) -> LLM:
    return LLM(tiny_models["llama"], speculative_config=_spec(drafts["noisy"]), **KW)


@pytest.mark.parametrize("which", ["self", "noisy", "small"])
def test_greedy_identical_with_prefix_hits(tiny_models, drafts, base, which):
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    llm = LLM(tiny_models["llama"], speculative_config=_spec(drafts[which], k=3), **KW)
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


def test_chunked_prefill_and_preemption(tiny_models, drafts, base):
    prompts = _prompts(1)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = _toks(base.generate(prompts, sp, use_tqdm=False))
    llm = LLM(
        tiny_models["llama"],
        speculative_config=_spec(drafts["noisy"]),
        max_num_batched_tokens=7,
        num_kv_blocks=14,
        **KW,
    )
    assert _toks(llm.generate(prompts, sp, use_tqdm=False)) == ref
    sched = llm.core.scheduler
    assert sched.num_preemptions > 0 and sched.spec_stats.num_accepted_tokens > 0
    _check_idle(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_accepted_run(tiny_models, drafts, base, max_tokens):
    prompts = _prompts(2)[:4]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(tiny_models["llama"], speculative_config=_spec(drafts["self"], k=4), **KW)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert _toks(got) == _toks(base.generate(prompts, sp, use_tqdm=False))
    assert all(len(c.token_ids) == max_tokens for o in got for c in o.outputs)


def test_stop_ids_min_tokens_n_and_logprobs(base, noisy):
    prompts = _prompts(3)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = _toks(base.generate(prompts, plain, use_tqdm=False))
    stop = ref[0][5]  # occurs inside the output: the sequence ends there
    cases = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop]),
        SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], min_tokens=8
        ),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2),
    ]
    for sp in cases:
        want = _toks(base.generate(prompts, sp, use_tqdm=False))
        assert _toks(noisy.generate(prompts, sp, use_tqdm=False)) == want
    lp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = base.generate(prompts, lp, use_tqdm=False)
    got = noisy.generate(prompts, lp, use_tqdm=False)
    assert _toks(got) == _toks(want)
    for w, g in zip(want, got, strict=True):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert len(wl) == len(gl) == len(w.outputs[0].token_ids)
        for a, b in zip(wl, gl, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
                assert a[t].rank == b[t].rank
    _check_idle(noisy)


def test_sampled_seeded_reproducible_and_self_draft_accepts(tiny_models, drafts, noisy):
    prompts = _prompts(4)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    first = _toks(noisy.generate(prompts, sp, use_tqdm=False))
    assert first == _toks(noisy.generate(prompts, sp, use_tqdm=False))
    # the target as its own draft: q equals p (up to rounding), so sampled guesses are kept
    llm = LLM(tiny_models["llama"], speculative_config=_spec(drafts["self"]), **KW)
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
    fast = LLM(smollm_dir, device="cpu", dtype="float32", speculative_config=_spec(smollm_dir))
    for sp, want in zip(params, wants, strict=True):
        got = fast.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert got.text == want.text and list(got.token_ids) == list(want.token_ids)
        assert got.finish_reason == want.finish_reason
    stats = fast.core.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0, stats
