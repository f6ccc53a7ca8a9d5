"""Tensor parallelism on the CPU (gloo, two ranks): greedy tokens equal tp=1 and transformers,
with chunked prefill and prefix reuse; bad sizes refused with the numbers; a killed rank is
an engine error naming it, with no process left behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.distributed.worker_group import WorkerFailure
from model_factory import edited_copy, hf_greedy

PROMPTS = [
    [1, 5, 9, 33, 2, 7],
    [4, 4, 4, 4, 8, 100, 200, 3, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
]
# shares its first 16 tokens (a full block) with PROMPTS[2]: a prefix-cache hit
PREFIX_PROMPT = PROMPTS[2][:16] + [40, 41, 42]
MAX_NEW = 10
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory=0.01, max_num_batched_tokens=16)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _tiny_odd_vocab(path: str) -> str:
    """A Llama with one KV head (replicated over the ranks) and a vocabulary that two ranks
    split unevenly (the last shard padded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=323, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
        initializer_range=0.15, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def _children() -> set[int]:
    """This process's spawned ranks (not multiprocessing's resource tracker)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory) -> str:
    return _tiny_odd_vocab(str(tmp_path_factory.mktemp("tp") / "llama_kv1"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "mistral", "smollm3"])
def test_tp2_matches_tp1_and_hf(tiny_models, arch):
    """GQA 4/2 over sharded safetensors files (llama), qkv bias (qwen2), checkpoints with
    q/k/v and gate/up already fused (phi3), a layer without rotary (smollm3); prompts longer than the 16-token step budget run
    as chunked prefill; the last prompt reuses a cached block."""
    path = tiny_models[arch]
    prompts = PROMPTS + [PREFIX_PROMPT]
    ref = hf_greedy(path, prompts, MAX_NEW)
    one = _greedy(LLM(path, **ENGINE), prompts)
    before = _children()
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    workers = _children() - before
    assert len(workers) == 1  # rank 1 (rank 0 is this process)
    got = _greedy(llm, PROMPTS) + _greedy(llm, [PREFIX_PROMPT])  # the prefix is cached now
    assert llm.core.get_stats().prefix_cache_hits >= 16
    assert got == one == ref
    llm.core.shutdown()
    psutil.wait_procs([psutil.Process(p) for p in workers if psutil.pid_exists(p)], timeout=10)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers)


def test_tp2_replicated_kv_head_padded_vocab(odd_vocab_dir):
    ref = hf_greedy(odd_vocab_dir, PROMPTS, MAX_NEW)
    llm = LLM(odd_vocab_dir, tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.core.runner.num_kv_heads == 1 and llm.core.runner.num_heads == 2
        assert _greedy(llm, PROMPTS) == ref
        # sampled (not greedy) tokens come from rank 0 alone: seeded runs repeat exactly
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW)
        a = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert a == b
    finally:
        llm.core.shutdown()


def test_tp2_preemption_recomputes_the_same_tokens(odd_vocab_dir):
    """Four 16-token blocks for three requests that need one, two and three: the newest is
    preempted and recomputed on both ranks, and the tokens still equal transformers'."""
    ref = hf_greedy(odd_vocab_dir, PROMPTS, MAX_NEW)
    llm = LLM(odd_vocab_dir, tensor_parallel_size=2, **{**ENGINE, "num_kv_blocks": 4})
    try:
        assert _greedy(llm, PROMPTS) == ref
        assert llm.core.get_stats().num_preemptions_total > 0
    finally:
        llm.core.shutdown()


def test_embedded_model_tp3_and_refusals(smollm_dir):
    """SmolLM2 (9 heads, 3 KV heads): tp=2 is refused naming the heads; tp=3 runs."""
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=9"
    ):
        LLM(smollm_dir, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=6 is not a multiple of num_key_value_heads=3|tensor_parallel_size=6 does not divide",
    ):
        LLM(smollm_dir, tensor_parallel_size=6, **ENGINE)
    with pytest.raises(ValueError, match="distributed_backend=nccl needs CUDA"):
        LLM(smollm_dir, tensor_parallel_size=3, distributed_backend="nccl", **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        LLM(smollm_dir, tensor_parallel_size=0, **ENGINE)
    prompts = PROMPTS[:2]  # three ranks on the CPU's cores: a few tokens each
    params = SamplingParams(temperature=0, max_tokens=4)
    one = [o.outputs[0].token_ids for o in LLM(smollm_dir, **ENGINE).generate(prompts, params, use_tqdm=False)]
    llm = LLM(smollm_dir, tensor_parallel_size=3, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == one
    finally:
        llm.core.shutdown()


def test_unsupported_architecture_and_draft_model_refused(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="MixtralForCausalLM does not support tensor parallelism"):
        LLM(tiny_models["mixtral"], tensor_parallel_size=2, **ENGINE)
    biased = edited_copy(tiny_models["llama"], tmp_path / "biased", attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        LLM(biased, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match='"draft_model" is not supported with tensor_parallel'):
        LLM(
            tiny_models["llama"],
            tensor_parallel_size=2,
            speculative_config={
                "method": "draft_model",
                "model": tiny_models["llama"],
                "num_speculative_tokens": 2,
            },
            **ENGINE,
        )


def test_fp8_tp2_is_as_close_to_float_as_tp1(tiny_models):
    """FP8 weights over two ranks: each row-parallel slice has its own scales, so the logits are
    not bit-equal to one rank's, but as close to the float32 model's (a wrong scale or a shard
    quantized twice would be far off)."""
    path, prompts = tiny_models["llama"], PROMPTS[:2]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)

    def first_logprobs(**kw) -> list[dict[int, float]]:
        llm = LLM(path, **ENGINE, **kw)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:  # the next test's ranks need this process's group gone
            llm.core.shutdown()
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    ref = first_logprobs()
    errors = {}
    for tp in (1, 2):
        got = first_logprobs(quantization="fp8", tensor_parallel_size=tp)
        errors[tp] = max(
            sum(abs(r[t] - g[t]) for t in r.keys() & g.keys()) / len(r.keys() & g.keys())
            for r, g in zip(ref, got, strict=True)
        )
    assert 0 < errors[2] < max(2 * errors[1], 0.05), errors


def test_killed_rank_is_an_error_naming_it(tiny_models):
    before = _children()
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **ENGINE)
    (worker,) = _children() - before
    assert _greedy(llm, PROMPTS[:1])
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.monotonic()
    with pytest.raises(
        WorkerFailure, match=rf"rank 1 \(pid {worker}\) was killed by signal SIGKILL"
    ):
        _greedy(llm, PROMPTS)
    assert time.monotonic() - t0 < 30  # an error, not a hang (bounded well below the timeout)
    llm.core.shutdown()
    assert not (_children() - before)


def test_worker_that_fails_to_start_names_its_error(tiny_models, tmp_path):
    """A rank whose start-up raises (here: a weights file it cannot read) is named with its
    error, and start-up fails instead of waiting for the timeout."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen2"], bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    before = _children()
    with pytest.raises(ValueError, match="model weights: cannot read"):
        LLM(str(bad), tensor_parallel_size=2, **ENGINE)  # rank 0 reads the same file
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (_children() - before)


def test_tp2_embeddings_equal_tp1(tiny_models):
    """runner pooling over two ranks: every rank pools (no LM head, no vocabulary collective);
    rank 0's vectors, mean-pooled over chunked prefill, equal one rank's."""
    path = tiny_models["qwen3"]
    engine = dict(ENGINE, runner="pooling", pooling_type="mean")
    one = [o.outputs.embedding for o in LLM(path, **engine).embed(PROMPTS, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, **engine)
    try:
        two = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    finally:
        llm.core.shutdown()
    for a, b in zip(one, two, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
