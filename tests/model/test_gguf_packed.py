"""GGUF blocks kept packed (``quantization="gguf"``, ``quant/gguf.py``): repacked blocks equal
``gguf``'s own dequantizer, and the embedded SmolLM2 (Q4_1) decodes on its packed weights
exactly as on the weights dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.kernels import w4a16_common
from fulcrum.quant.gguf import GgufLinear, repack_blocks


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_repacked_blocks_equal_gguf_dequantizer(type_name: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    n, k = 24, 96
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    w += np.linspace(-1, 2, k, dtype=np.float32)  # groups off zero: Q4_1's min matters
    blocks = gguf.quants.quantize(w, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    t = repack_blocks(blocks, type_name, n, k)
    bits = 8 if type_name == "Q8_0" else 4
    got = w4a16_common.dequantize(t["qweight"], t["zeros"], t["scales"], 32, bits, t["mins"]).t()
    assert torch.equal(got, want)
    assert t["qweight"].shape == (k * bits // 32, n) and t["scales"].shape == (k // 32, n)


def test_other_types_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="type Q5_0; packed GGUF supports Q4_0, Q4_1, Q8_0, Q4_K"):
        repack_blocks(np.zeros((4, 176), np.uint8), "Q5_0", 4, 256)


def test_gguf_needs_a_gguf_file(tiny_models) -> None:
    with pytest.raises(ValueError, match="quantization: gguf keeps a GGUF file's blocks packed"):
        LLM(tiny_models["llama"], device="cpu", quantization="gguf")


def test_smollm2_on_packed_q4_1(smollm_dir) -> None:
    """Every projection's packed weight equals what the default path dequantizes at load (the
    converted checkpoint), and greedy decoding equals transformers on those weights."""
    from safetensors import safe_open

    from model_factory import hf_greedy

    prompts = [[1, 504, 3458, 314, 216]]
    llm = LLM(device="cpu", quantization="gguf")
    model = llm.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GgufLinear) and len(qkv.parts) == 1  # q, k, v: one Q4_1 run
    part = qkv.parts[0]
    assert part.type_name == "Q4_1" and part.bits == 4 and part.mins is not None
    assert part.qweight.dtype == torch.int32 and part.qweight.shape == (576 // 8, 576 + 2 * 192)
    with safe_open(f"{smollm_dir}/model.safetensors", framework="pt") as fh:
        for i in (0, 17, 29):
            layer = model.model.layers[i]
            pre = f"model.layers.{i}."
            parts = {
                layer.self_attn.qkv_proj: [
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                ],
                layer.self_attn.o_proj: ["self_attn.o_proj"],
                layer.mlp.gate_up_proj: ["mlp.gate_proj", "mlp.up_proj"],
                layer.mlp.down_proj: ["mlp.down_proj"],
            }
            for lin, names in parts.items():
                want = torch.cat([fh.get_tensor(f"{pre}{n}.weight") for n in names])
                assert torch.equal(lin.dequantized_weight(), want), (i, names)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == hf_greedy(smollm_dir, prompts, 6)
