"""GPTQ and AWQ checkpoints (``quant/int4.py``) on the CPU: each layout, written by the tests'
quantizer, dequantizes to what the format's description gives, and greedy decoding equals
transformers running the same model with those dequantized weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.quant.int4 import IntLinear
from int_quantizer import checkpoint_maker, dequantize_reference, quantize_linear, with_config
from model_factory import hf_greedy

# (method, bits, group_size, sym, desc_act): each layout and option once
FORMATS = {
    "gptq4_g32_sym": ("gptq", 4, 32, True, False),
    "gptq4_g16_asym_actorder": ("gptq", 4, 16, False, True),
    "gptq8_gall_sym": ("gptq", 8, -1, True, False),
    "gptq4_g64_asym": ("gptq", 4, 64, False, False),
    "awq4_g32": ("awq", 4, 32, False, False),
}
PROMPTS = [list(range(5, 11)), list(range(20, 57)), [7] * 3 + list(range(100, 140))]


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """(arch, format) -> (checkpoint dir, reference dir), written on first use."""
    return checkpoint_maker(tiny_models, tmp_path_factory.mktemp("int4"), FORMATS, seed=3)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_layer_dequantizes_like_the_format_description(fmt: str) -> None:
    """One layer loaded in two shards (as q/k/v fuse) repacks to exactly the reference
    dequantizer's weight, which is close to the original (round-to-nearest per group)."""
    from fulcrum.quant import get_quant_method

    method, bits, gs, sym, act = FORMATS[fmt]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * 0.1
    qc = {"quant_method": method, "bits": bits, "group_size": gs, "sym": sym, "desc_act": act}
    parts = [quantize_linear(w[:32], method, bits, gs, sym, act, torch.Generator().manual_seed(1)),
             quantize_linear(w[32:], method, bits, gs, sym, act, torch.Generator().manual_seed(1))]  # fmt: skip
    lin = get_quant_method(method, qc).linear(64, 48, bias=False)
    assert isinstance(lin, IntLinear)
    lin.check_format("layers.0.qkv_proj")
    for (start, size), t in zip(((0, 32), (32, 16)), parts, strict=True):
        for leaf, tensor in t.items():
            assert lin.load_packed(leaf, tensor, (start, size))
    lin.finish_loading()
    want = torch.cat([dequantize_reference(t, method, bits, gs) for t in parts])
    assert torch.equal(lin.dequantized_weight(), want)
    assert (want - w).abs().max() <= w.abs().max() / ((1 << (bits - 1)) - 1)  # under a step
    assert lin.qweight.shape == (64 * bits // 32, 48) and lin.qweight.dtype == torch.int32
    assert (lin.perm is not None) == act
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(lin(x), x @ want.t(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", f) for f in FORMATS] + [("qwen2", "gptq4_g16_asym_actorder"), ("qwen2", "awq4_g32")],
)
def test_greedy_equals_transformers_on_dequantized_weights(quantized, arch: str, fmt: str) -> None:
    dst, ref = quantized(arch, fmt)
    want = hf_greedy(ref, PROMPTS, 10)
    llm = LLM(dst, device="cpu", dtype="float32", max_num_batched_tokens=32)
    model = llm.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, IntLinear) and qkv.packed and qkv.fmt.method == FORMATS[fmt][0]
    assert model.lm_head.weight.dtype == torch.float32  # stays unquantized
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"bits": 3}, r"quantization_config\.bits: gptq supports 4 and 8 bits, got 3"),
        ({"checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format"),
        (
            {"group_size": 128},
            r"model\.layers\.0\.self_attn\.qkv_proj: quantization_config\."
            r"group_size 128 does not divide the layer's 64 input",
        ),  # fmt: skip
        ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method"),
    ],
)
def test_unsupported_formats_fail_at_load(quantized, tmp_path, changes, match: str) -> None:
    dst, _ = quantized("llama", "gptq4_g32_sym")
    bad = with_config(dst, str(tmp_path / "bad"), changes)
    with pytest.raises(ValueError, match=match):
        LLM(bad, device="cpu", dtype="float32")


def test_awq_options_are_checked() -> None:
    from fulcrum.quant.int_format import IntWeightFormat

    with pytest.raises(ValueError, match=r"quantization_config\.version"):
        IntWeightFormat.from_config("awq", {"version": "gemv"})
    with pytest.raises(ValueError, match=r"quantization_config\.zero_point"):
        IntWeightFormat.from_config("awq", {"zero_point": False})


def test_requested_method_must_match_the_checkpoint(quantized, tiny_models) -> None:
    dst, _ = quantized("llama", "gptq4_g32_sym")
    with pytest.raises(ValueError, match="the checkpoint is gptq-quantized"):
        LLM(dst, device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="gptq reads gptq checkpoints"):
        LLM(tiny_models["llama"], device="cpu", quantization="gptq")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dummy_packed_weights(tiny_models, tmp_path, method: str) -> None:
    """Dummy init writes the kernels' packed layout directly; the engine generates. (The
    default group of 128 does not divide the tiny model's 64 features: the config says 32.)"""
    with open(os.path.join(tiny_models["llama"], "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"] = {"quant_method": method, "group_size": 32}
    with open(tmp_path / "config.json", "w") as fh:
        json.dump(config, fh)
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", quantization=method)
    layers = [m for m in llm.core.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 8
    for m in layers:
        assert m.packed and m.qweight.dtype == torch.int32 and m.qweight.float().std() > 0
        w = m.dequantized_weight()
        assert w.abs().max() <= 0.0201 and w.std() > 0  # fp16 scales
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
