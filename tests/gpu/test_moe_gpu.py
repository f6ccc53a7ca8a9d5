"""The fused MoE kernels on CUDA at Mixtral-8x7B and Qwen3-30B-A3B expert shapes (bf16 and FP8
experts) against the torch loop, inside a CUDA graph, and MoE engines end to end: tiny random
Mixtral / Qwen3-MoE / Qwen2-MoE against transformers' logprobs, and dummy-weight engines at the
real shapes (two layers)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum import LLM, SamplingParams  # noqa: E402
from fulcrum.kernels.fused_moe import fused_moe  # noqa: E402
from fulcrum.kernels.moe_routing import moe_align_block_size, topk_softmax  # noqa: E402
from fulcrum.kernels.quant_fp8 import per_token_quant_fp8_ref  # noqa: E402
from fulcrum.model.layers.moe_ref import (  # noqa: E402
    fused_moe_ref,
    moe_align_block_size_ref,
    topk_softmax_ref,
)
from fulcrum.model.loader.resolve import CONFIGS_DIR  # noqa: E402
from model_factory import assert_first_divergence_in_top, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
# (name, experts, top-k, hidden, expert intermediate, renormalise)
SHAPES = [("mixtral-8x7b", 8, 2, 4096, 14336, True), ("qwen3-30b-a3b", 128, 8, 2048, 768, True)]


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _experts(e, h, inter, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEV, generator=g) / inter**0.5).bfloat16()
    return w13, w2


def _route(t, e, k, renorm, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(t, e, device=DEV, generator=g)  # fp32: no ties between experts
    return logits, *topk_softmax_ref(logits, k, renorm)


def _ref_fp32(x, w13, w2, weights, ids, s13=None, s2=None):
    """The torch loop in fp32 on the same (bf16-rounded) operands."""
    if s13 is None:
        return fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    return fused_moe_ref(x.float(), w13, w2, weights, ids, s13, s2)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_fused_moe_bf16_at_model_shapes(shape, t) -> None:
    _, e, k, h, inter, renorm = shape
    w13, w2 = _experts(e, h, inter)
    logits, weights, ids = _route(t, e, k, renorm)
    w, i = topk_softmax(logits, k, renorm)
    assert torch.equal(i, ids)
    torch.testing.assert_close(w, weights)
    x = torch.randn(t, h, device=DEV).bfloat16()
    out = fused_moe(x, w13, w2, weights, ids)
    ref = _ref_fp32(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("e,k,t,block_m", [(8, 2, 1, 16), (60, 4, 33, 16), (128, 8, 512, 64),
                                           (128, 8, 4096, 128)])  # fmt: skip
def test_align_on_cuda_matches_torch(e, k, t, block_m) -> None:
    _, _, ids = _route(t, e, k, True, seed=t)
    got_sorted, got_experts, num = moe_align_block_size(ids, e, block_m)
    ref_sorted, ref_experts, total = moe_align_block_size_ref(ids, e, block_m)
    assert int(num) == total
    assert torch.equal(got_sorted[:total], ref_sorted)
    assert torch.equal(got_experts[: total // block_m], ref_experts)


def test_fused_moe_fp8_experts_on_cuda() -> None:
    e, k, h, inter = 8, 2, 4096, 14336
    w13, w2 = _experts(e, h, inter, seed=3)
    q13, s13 = per_token_quant_fp8_ref(w13.reshape(-1, h))
    q2, s2 = per_token_quant_fp8_ref(w2.reshape(-1, inter))
    q13, q2 = q13.view(e, 2 * inter, h), q2.view(e, h, inter)
    s13, s2 = s13.view(e, 2 * inter), s2.view(e, h)
    del w13, w2
    for t in (1, 64):
        _, weights, ids = _route(t, e, k, True, seed=t)
        x = torch.randn(t, h, device=DEV).bfloat16()
        out = fused_moe(x, q13, q2, weights, ids, s13, s2)
        ref = _ref_fp32(x, q13, q2, weights, ids, s13, s2)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    # FP8 activations (W8A8, FP8 tensor cores) at a prefill's rows: within the e4m3 rounding of
    # the activations (~2 significant digits) of the weight-only result.
    for t in (64, 512):
        _, weights, ids = _route(t, e, k, True, seed=t)
        x = torch.randn(t, h, device=DEV).bfloat16()
        w8a8 = fused_moe(x, q13, q2, weights, ids, s13, s2, act_fp8_rows=1).float()
        ref = _ref_fp32(x, q13, q2, weights, ids, s13, s2)
        err = (w8a8 - ref).norm() / ref.norm()
        assert err < 0.05, err


def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """Sizes never depend on the routing: a captured graph replays new routings correctly,
    experts without tokens included."""
    _, e, k, h, inter, renorm = SHAPES[1]
    w13, w2 = _experts(e, h, inter, seed=5)
    t = 16
    x = torch.randn(t, h, device=DEV).bfloat16()
    logits = torch.randn(t, e, device=DEV)

    def step():
        weights, ids = topk_softmax(logits, k, renorm)
        return fused_moe(x, w13, w2, weights, ids)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(t, h, device=DEV, generator=g))
        logits.copy_(torch.randn(t, e, device=DEV, generator=g))
        if seed == 2:
            logits[:, 16:] -= 100.0  # every token among the first 16 experts
        graph.replay()
        weights, ids = topk_softmax_ref(logits, k, renorm)
        ref = _ref_fp32(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


# -- engines --------------------------------------------------------------------------------------


def _greedy(llm: LLM, prompts, n: int):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [list(d) for d in o.outputs[0].logprobs]) for o in outs]


def _hf_greedy_top(path: str, prompts, n: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    res = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)  # fmt: skip
        toks = out.sequences[0, len(p) :].tolist()
        res.append((toks, [s[0].topk(5).indices.tolist() for s in out.scores]))
    return res


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("fused", [True, False])
def test_tiny_moe_engine_bf16_close_to_hf(tmp_path, arch, fused) -> None:
    path = make_tiny_model(str(tmp_path / arch), arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 320, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9)]
    # The reference runs in bf16 too (on the CPU): a tiny random MoE's routing flips between
    # float32 and bf16 (transformers' own Mixtral leaves float32's tokens on one of these
    # prompts), so only the same precision is comparable token by token.
    ref = _hf_greedy_top(path, prompts, 16, torch.bfloat16)
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8,
              kernel_config={"fused_moe": fused})  # fmt: skip
    got = _greedy(llm, prompts, 16)
    for i, ((a, at), (b, bt)) in enumerate(zip(got, ref, strict=True)):
        assert_first_divergence_in_top(a, at, b, bt, f"{arch} fused={fused} prompt {i}")


@pytest.mark.parametrize("entry", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_dummy_moe_engine_runs_at_real_shapes(tmp_path, entry, quant) -> None:
    """Two layers of the real model (all experts), dummy weights, CUDA graphs: a batch decodes
    to its length, and the graphs' tokens equal the eager engine's."""
    with open(f"{CONFIGS_DIR}/{entry}.json") as fh:
        cfg = json.load(fh)
    cfg["num_hidden_layers"] = 2
    cfg_file = tmp_path / f"{entry}-2l.json"
    cfg_file.write_text(json.dumps(cfg))
    prompts = [list(range(10, 10 + n)) for n in (5, 50, 200, 1)]
    outs = {}
    for eager in (False, True):
        llm = LLM(str(cfg_file), load_format="dummy", device="cuda", dtype="bfloat16",
                  quantization=quant, max_model_len=1024, num_kv_blocks=512,
                  max_num_seqs=8, enforce_eager=eager)  # fmt: skip
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert all(len(t) == 24 for t in outs[eager])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs[False], outs[True], strict=True))
    assert same >= len(prompts) - 1, outs  # bf16 rounding may flip one near-tie
