"""Mixture-of-experts models beyond the shared parity matrix: Qwen2-MoE (shared expert behind a
sigmoid gate) against transformers, FP8 experts, and the experts' paths against each other."""

from __future__ import annotations

import random

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.model.layers.experts import Experts, _every_expert
from fulcrum.model.layers.moe_ref import fused_moe_ref, topk_softmax_ref
from model_factory import assert_first_divergence_in_top, hf_greedy, make_tiny_model


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2_moe"), "qwen2_moe")


def _greedy(llm: LLM, prompts, n: int, logprobs: int | None = None):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    return llm.generate(prompts, sp, use_tqdm=False)


def test_qwen2_moe_matches_hf(qwen2_moe) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(3, 320) for _ in range(20)]  # a common prefix: the radix cache hits
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 50))] for _ in range(4)]
    prompts += [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 9)]
    ref = hf_greedy(qwen2_moe, prompts, 16)
    for kwargs in (
        dict(),
        dict(max_num_batched_tokens=5),  # chunked prefill
        dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=6),  # preemption
    ):
        llm = LLM(qwen2_moe, dtype="float32", device="cpu", **kwargs)
        assert [o.outputs[0].token_ids for o in _greedy(llm, prompts, 16)] == ref, kwargs
        if kwargs.get("num_kv_blocks"):
            assert llm.stats()["num_preemptions_total"] > 0
        else:  # the shared prefix again, now cached
            again = _greedy(llm, prompts[-2:], 16)
            assert [o.outputs[0].token_ids for o in again] == ref[-2:]
            assert all(o.num_cached_tokens >= 16 for o in again)
        llm.core.scheduler.kv.check_integrity()
    mlp = llm.core.runner.model.model.layers[0].mlp
    assert mlp.shared_expert.gate_up_proj.weight.shape == (96, 64)  # shared_expert_intermediate


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fp8_experts_close_to_full_precision(tiny_models, qwen2_moe, arch) -> None:
    path = qwen2_moe if arch == "qwen2_moe" else tiny_models[arch]
    prompts = [list(range(5, 11)), list(range(20, 57)), [7] * 3 + list(range(100, 140))]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    ref = _greedy(LLM(path, **kw), prompts, 12, logprobs=5)
    llm = LLM(path, quantization="fp8", **kw)
    experts = llm.core.runner.model.model.layers[0].mlp if arch != "mixtral" else \
        llm.core.runner.model.model.layers[0].block_sparse_moe  # fmt: skip
    assert experts.experts.w13.dtype == torch.float8_e4m3fn
    assert (experts.experts.w2_scale > 0).all() and experts.gate.weight.dtype == torch.float32
    got = _greedy(llm, prompts, 12, logprobs=5)
    for i, (o, r) in enumerate(zip(got, ref, strict=True)):
        a, b = o.outputs[0], r.outputs[0]
        assert_first_divergence_in_top(
            a.token_ids, [list(d) for d in a.logprobs], b.token_ids,
            [list(d) for d in b.logprobs], f"prompt {i}",
        )  # fmt: skip


def test_dummy_fp8_experts(tiny_models) -> None:
    llm = LLM(tiny_models["qwen3_moe"], device="cpu", load_format="dummy", quantization="fp8")
    for m in llm.core.runner.model.modules():
        if isinstance(m, Experts):
            for w, s in ((m.w13, m.w13_scale), (m.w2, m.w2_scale)):
                assert w.dtype == torch.float8_e4m3fn and w.float().std() > 0 and (s > 0).all()
    out = _greedy(llm, [[1, 2, 3]], 4)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unsupported_quantization_names_the_field(tiny_models) -> None:
    with pytest.raises(ValueError, match="quantization: 'gptq'.*mixture-of-experts"):
        LLM(tiny_models["mixtral"], device="cpu", load_format="dummy", quantization="gptq")


def test_every_expert_path_equals_the_loop() -> None:
    """The capture-safe path (every expert on every row, no host sync) against the loop."""
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 7, 32, 16, 6, 2
    x = torch.randn(t, h, generator=g)
    ex = Experts(e, h, inter)
    ex.w13.data.normal_(generator=g)
    ex.w2.data.normal_(generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 3:] -= 50  # experts 3..5 unused
    weights, ids = topk_softmax_ref(logits, k, renormalize=False)
    ref = fused_moe_ref(x, ex.w13, ex.w2, weights, ids)
    got = _every_expert(x, ex.w13, ex.w2, weights, ids, None, None)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ex(x, weights, ids), ref)  # the CPU path is the loop
