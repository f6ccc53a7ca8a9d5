"""Sliding-window attention end to end: Mistral-style windows on every layer (KV blocks out of the
window released during a long generation), per-layer windows (Qwen2), windows as long as any
sequence (full attention), all against transformers."""

from __future__ import annotations

import random

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.kv_cache.sliding_window import kv_free_window, layer_windows
from fulcrum.model.loader.hf_config import HFConfig
from model_factory import edited_copy, generate_watching, hf_greedy

WINDOW, BS = 12, 4


@pytest.fixture(scope="module")
def windowed(tiny_models, tmp_path_factory) -> str:
    """The tiny Mistral with a 12-token window on both layers."""
    return edited_copy(
        tiny_models["mistral"], tmp_path_factory.mktemp("swa") / "m", sliding_window=WINDOW
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 23, 41)]


@pytest.fixture(scope="module")
def reference(windowed, prompts) -> list[list[int]]:
    return hf_greedy(windowed, prompts, 48)


# Slack over window / block_size: the block holding the window's first key, the block being
# written, and one more scheduled while the previous step is in flight.
BOUND = WINDOW // BS + 3


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        # chunked prefill past the window, no cache
        dict(max_num_batched_tokens=7, enable_prefix_caching=False),
        dict(async_scheduling="on"),
    ],
)
def test_long_generation_frees_blocks_and_matches_hf(windowed, prompts, reference, kwargs):
    llm = LLM(windowed, dtype="float32", device="cpu", block_size=BS, **kwargs)
    assert llm.core.scheduler.kv.sliding_window == WINDOW
    # one request at a time: its own footprint, prompt and 48 generated tokens
    for p, ref in zip(prompts, reference, strict=True):
        toks, peak = generate_watching(llm, [p], 48)
        assert toks == [ref]
        assert peak["held"] <= BOUND, peak
    # with caching, the prompt blocks stay pinned until the request holds none of them
    pinned = len(prompts[-1]) // BS if llm.core.scheduler.kv.tree is not None else 0
    assert peak["used"] <= BOUND + pinned, peak
    # together: each request keeps its own bound, and the pool stays far below the full length
    toks, peak = generate_watching(llm, prompts, 48)
    assert toks == reference
    assert peak["held"] <= BOUND
    full = sum(-(-(len(p) + 48) // BS) for p in prompts)
    assert peak["used"] < full // 2, (peak, full)
    kv = llm.core.scheduler.kv
    assert kv.num_available == kv.num_blocks  # idle: everything free or evictable


def test_prefix_hits_stay_exact(windowed, prompts, reference):
    """A second pass reuses every prompt's cached blocks (prompts longer than the window too)
    and still equals transformers; preemption under a small pool recomputes exactly."""
    llm = LLM(windowed, dtype="float32", device="cpu", block_size=BS)
    assert generate_watching(llm, prompts, 48)[0] == reference
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // BS * BS for p in prompts]
    kv = llm.core.scheduler.kv
    assert kv.num_available == kv.num_blocks and kv.tree.protected_size == 0
    # n > 1 shares the prompt (a sibling waits for it, then matches it in the cache)
    n2 = llm.generate(
        [prompts[2]], SamplingParams(temperature=0, max_tokens=48, n=2), use_tqdm=False
    )[0]
    assert [c.token_ids for c in n2.outputs] == [reference[2]] * 2
    small = LLM(windowed, dtype="float32", device="cpu", block_size=BS, num_kv_blocks=24)
    toks, _ = generate_watching(small, prompts + prompts, 48)
    assert toks == reference + reference
    assert small.stats()["num_preemptions_total"] > 0


def test_siblings_without_prefix_cache(windowed, prompts, reference):
    llm = LLM(windowed, dtype="float32", device="cpu", block_size=BS, enable_prefix_caching=False)
    out = llm.generate(
        [prompts[2]], SamplingParams(temperature=0, max_tokens=48, n=3), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3
    llm.core.scheduler.kv.check_integrity()


def test_window_as_long_as_any_sequence_is_full_attention(tiny_models, tmp_path, prompts):
    """sliding_window >= max_model_len: no mask, no freeing, transformers' tokens."""
    d = edited_copy(tiny_models["mistral"], tmp_path / "m", sliding_window=96)
    llm = LLM(d, dtype="float32", device="cpu", block_size=BS, max_model_len=96)
    layers = llm.core.runner.model.model.layers
    assert all(la.self_attn.backend.sliding_window is None for la in layers)
    assert llm.core.scheduler.kv.sliding_window is None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, 40)
    # one token shorter than max_model_len: the last position would miss key 0
    d = edited_copy(tiny_models["mistral"], tmp_path / "m95", sliding_window=95)
    llm = LLM(d, dtype="float32", device="cpu", block_size=BS, max_model_len=96)
    assert llm.core.scheduler.kv.sliding_window == 95


def test_per_layer_windows_qwen2(tiny_models, tmp_path, prompts):
    """Qwen2's use_sliding_window / max_window_layers: layer 1 windowed, layer 0 global, so
    nothing is freed; tokens equal transformers'."""
    d = edited_copy(
        tiny_models["qwen2"], tmp_path / "q", use_sliding_window=True, sliding_window=10,
        max_window_layers=1, layer_types=None,
    )  # fmt: skip
    llm = LLM(d, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=9)
    windows = [la.self_attn.backend.sliding_window for la in llm.core.runner.model.model.layers]
    assert windows == [None, 10]
    assert llm.core.scheduler.kv.sliding_window is None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(d, prompts, 24)


def test_layer_windows_read_from_configs():
    from transformers import Gemma2Config, MistralConfig, Phi3Config, Qwen2Config, Qwen3MoeConfig

    m = MistralConfig(num_hidden_layers=3, sliding_window=4096)
    assert layer_windows(m, 4096) == [None] * 3  # as long as any sequence: full attention
    assert layer_windows(m, 8192) == [4096] * 3 and kv_free_window(layer_windows(m, 8192)) == 4096
    assert (
        layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None), 10**6) == [None] * 2
    )
    assert layer_windows(Phi3Config(num_hidden_layers=2, sliding_window=2047), 4096) == [2047] * 2
    g = Gemma2Config(num_hidden_layers=4, sliding_window=4096)
    assert layer_windows(g, 8192) == [4096, None, 4096, None]
    assert kv_free_window(layer_windows(g, 8192)) is None  # global layers read every key
    q = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert layer_windows(q, 1024) == [None, None, 64, 64]
    assert layer_windows(Qwen2Config(num_hidden_layers=2), 10**6) == [None, None]
    moe = Qwen3MoeConfig(num_hidden_layers=2, use_sliding_window=True, sliding_window=64)
    assert layer_windows(moe, 1024) == [64, 64]
    # raw config.json files without layer_types (as fulcrum reads them): transformers' defaults
    raw = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    for arch, want in (
        ("Qwen2ForCausalLM", [None, None, 64, 64]),
        ("Qwen2MoeForCausalLM", [64, None, None, None]),
    ):
        cfg = HFConfig({"model_type": "x", "architectures": [arch], **raw})
        assert layer_windows(cfg, 1024) == want, arch
    off = HFConfig(
        {
            "model_type": "qwen2",
            "num_hidden_layers": 2,
            "use_sliding_window": False,
            "sliding_window": 64,
        }
    )
    assert layer_windows(off, 1024) == [None, None]
    # a draft model with a global layer reading the same blocks: nothing may be freed
    assert kv_free_window([64, 64], [None]) is None and kv_free_window([64], [128]) == 128
    with pytest.raises(ValueError, match="layer_types"):
        layer_windows(
            MistralConfig(
                num_hidden_layers=2, sliding_window=8, layer_types=["chunked_attention"] * 2
            ),
            64,
        )


def test_triton_kernels_and_piecewise_graphs_apply_the_window(windowed, prompts, reference):
    """The Triton backend (interpreted) over tables whose early blocks were released and handed
    to the other request, eager and through the piecewise segment graphs (attention between
    segments goes through each layer's windowed backend), equals transformers."""
    from fulcrum.worker import startup

    kw = dict(dtype="float32", device="cpu", block_size=BS, attention_backend="triton")
    sp = SamplingParams(temperature=0, max_tokens=20)
    want = [r[:20] for r in reference[1:]]
    eager = LLM(windowed, **kw)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts[1:], sp, use_tqdm=False)] == want
    llm = LLM(windowed, max_num_batched_tokens=40, piecewise_graph_max_tokens=40, **kw)
    startup.capture_piecewise(llm.core.runner, emulate=True)
    assert llm.core.runner.piecewise is not None
    outs = llm.generate(prompts[1:], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.core.runner.piecewise.num_replays > 0
    llm.core.scheduler.kv.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_self"])
def test_speculation_over_released_blocks_is_lossless(windowed, prompts, reference, method):
    """Guesses verified over a window whose early blocks are gone, rejected ones rolled back
    (never behind a released block); a draft model that is the windowed target itself reads
    the same tables, so blocks are still released."""
    from spec_helpers import draft_spec

    spec = (
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
        if method == "ngram"
        else draft_spec(windowed)
    )
    llm = LLM(windowed, dtype="float32", device="cpu", block_size=BS, speculative_config=spec)
    assert llm.core.scheduler.kv.sliding_window == WINDOW
    toks, peak = generate_watching(llm, prompts, 48)
    assert toks == reference
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert peak["held"] <= BOUND + 1  # plus the guesses' block
