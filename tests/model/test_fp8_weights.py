"""FP8 weights (``quant/fp8.py``) on the CPU: the layer against its defining formula, loading
(fused shards, dummy init) and the engine end to end against the full-precision model."""

from __future__ import annotations

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.quant.fp8 import Fp8Linear, quantize_rows
from model_factory import assert_first_divergence_in_top


def test_fp8_linear_is_scaled_fp8_product() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48)[:, None]
    bias = torch.randn(48, generator=g)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-1, 2, 5)[:, None]
    lin = Fp8Linear(64, 48, bias=True)
    lin.weight_loader(w)
    lin.bias.data.copy_(bias)
    y = lin(x)
    # The definition: both operands rounded to e4m3 with their scales, products summed in fp32.
    qw, sw = quantize_rows(w)
    sx = x.abs().amax(-1, keepdim=True) / 448.0
    qx = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = (qx.float() * sx) @ (qw.float() * sw[:, None]).T + bias
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # And close to the full-precision layer (e4m3: ~3% per operand at worst).
    full = x @ w.T + bias
    assert ((y - full).norm(dim=-1) / full.norm(dim=-1)).max() < 0.05
    assert y.shape == (5, 48) and lin(x.view(1, 5, 64)).shape == (1, 5, 48)


def test_fused_shards_load_like_the_whole_matrix() -> None:
    """Scales are per output row, so q/k/v shards quantize independently of each other."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 32, generator=g)
    whole, parts = Fp8Linear(32, 96, bias=False), Fp8Linear(32, 96, bias=False)
    whole.weight_loader(w)
    for off, n in ((0, 64), (64, 16), (80, 16)):
        parts.weight_loader(w[off : off + n], off)
    assert torch.equal(whole.weight.view(torch.uint8), parts.weight.view(torch.uint8))
    assert torch.equal(whole.weight_scale, parts.weight_scale)
    with pytest.raises(ValueError, match="do not fit"):
        parts.weight_loader(w[:20], 80)


def _greedy_top(llm: LLM, prompts, n: int):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    tops = [[list(d) for d in o.outputs[0].logprobs] for o in outs]
    return toks, tops


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias
def test_fp8_engine_close_to_full_precision(tiny_models, arch: str) -> None:
    """Greedy decoding with FP8 weights against float32 weights (chunked prefill, a batch): at
    the first divergence each side's token is in the other's top-5."""
    prompts = [list(range(5, 11)), list(range(20, 57)), [7] * 3 + list(range(100, 140))]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    ref, ref_top = _greedy_top(LLM(tiny_models[arch], **kw), prompts, 12)
    llm = LLM(tiny_models[arch], quantization="fp8", **kw)
    layer = llm.core.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    lm_head = llm.core.runner.model.lm_head  # stays unquantized; on the CPU its weight may live
    # only in the oneDNN-packed copy, when start-up measures that copy faster at every row count
    held = lm_head.weight if lm_head.weight is not None else lm_head.packed
    assert held.dtype == torch.float32
    got, got_top = _greedy_top(llm, prompts, 12)
    for i in range(len(prompts)):
        assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"prompt {i}")


def test_dummy_fp8_weights(tiny_models) -> None:
    """Dummy init writes quantized rows directly (no full-precision model): every projection
    holds finite, non-constant FP8 values with positive scales, and the engine generates."""
    llm = LLM(tiny_models["llama"], device="cpu", load_format="dummy", quantization="fp8")
    for m in llm.core.runner.model.modules():
        if isinstance(m, Fp8Linear):
            w = m.weight.float()
            assert torch.isfinite(w).all() and w.std() > 0 and (m.weight_scale > 0).all()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantization_argument_is_validated() -> None:
    from fulcrum.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="quantization: unknown method 'int3'"):
        EngineArgs(model=None, quantization="int3", device="cpu").create_engine_config()


def test_fp8_smollm2_next_tokens_agree(smollm_dir, smollm_tokenizer) -> None:
    """The embedded chat model with FP8 weights, teacher-forced over a paragraph: its greedy next
    token agrees with the full-precision model's at most positions, and the full-precision
    choice is always in its top-5 (measured: 43 of 46 positions agree)."""
    text = (
        "The history of the Roman Empire spans more than a thousand years, from the founding of "
        "the city to the fall of Constantinople. Its legions built roads, aqueducts and cities "
        "across Europe, and its laws shaped the legal systems of many modern countries."
    )
    ids = smollm_tokenizer(text).input_ids
    prefixes = [ids[:n] for n in range(4, len(ids))]
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    firsts = {}
    for q in ("none", "fp8"):
        outs = LLM(smollm_dir, quantization=q).generate(prefixes, sp, use_tqdm=False)
        firsts[q] = [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]) for o in outs]
    pairs = list(zip(firsts["none"], firsts["fp8"], strict=True))
    assert all(ref in top for (ref, _), (_, top) in pairs)
    assert sum(ref == got for (ref, _), (got, _) in pairs) >= 0.85 * len(pairs)


def test_fp8_on_cpu_needs_no_scaled_mm(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU builds of torch whose ``_scaled_mm`` takes only per-tensor scales (the message below is
    theirs) still run FP8 models: the CPU path dequantizes the weights on the fly, which stay
    FP8 in memory, and greedy decoding stays close to the float32 model."""

    def per_tensor_only(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("_scaled_mm only supports per-tensor scaling for CPU backend")

    prompts = [list(range(5, 11)), list(range(20, 57))]
    kw = dict(device="cpu", dtype="float32", max_num_batched_tokens=32)
    ref, ref_top = _greedy_top(LLM(tiny_models["llama"], **kw), prompts, 8)
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    llm = LLM(tiny_models["llama"], quantization="fp8", **kw)
    fp8 = [m for m in llm.core.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    got, got_top = _greedy_top(llm, prompts, 8)
    for i in range(len(prompts)):
        assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"prompt {i}")
