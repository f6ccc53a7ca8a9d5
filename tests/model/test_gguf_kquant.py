"""GGUF K-quants kept packed (``quantization="gguf"``): a tiny random Llama written as a GGUF file
whose projections mix Q4_K, Q5_K, Q6_K and Q8_0 (as Q4_K_M files mix types inside q/k/v) loads
into packed parts equal to the dequantized checkpoint, and decodes greedily exactly as the same
engine on the weights dequantized at load and as transformers."""

from __future__ import annotations

import os
import types

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.quant.gguf import GgufLinear

TYPES = {  # (layer, projection): type; the rest Q4_K
    (0, "attn_v"): "Q6_K", (0, "attn_output"): "Q5_K", (0, "ffn_up"): "Q5_K",
    (0, "ffn_down"): "Q6_K", (1, "attn_q"): "Q8_0", (1, "attn_k"): "Q6_K",
    (1, "attn_v"): "Q6_K", (1, "ffn_gate"): "Q5_K", (1, "ffn_up"): "Q5_K",
}  # fmt: skip
PARTS = {  # layer -> projection -> its parts' types
    0: {"qkv_proj": ["Q4_K", "Q6_K"], "o_proj": ["Q5_K"], "gate_up_proj": ["Q4_K", "Q5_K"],
        "down_proj": ["Q6_K"]},
    1: {"qkv_proj": ["Q8_0", "Q6_K"], "o_proj": ["Q4_K"], "gate_up_proj": ["Q5_K"],
        "down_proj": ["Q4_K"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """The file and its converted (dequantized) directory, converted under a private cache."""
    from fulcrum.model.loader.gguf_loader import convert_gguf
    from gguf_kquant_writer import write_tiny_llama

    root = tmp_path_factory.mktemp("kquant")
    old = os.environ.get("FULCRUM_CACHE_DIR")
    os.environ["FULCRUM_CACHE_DIR"] = str(root / "cache")
    path = str(root / "tiny-kquant.gguf")
    write_tiny_llama(path, TYPES, seed=0)
    try:
        yield path, convert_gguf(path)
    finally:
        if old is None:
            os.environ.pop("FULCRUM_CACHE_DIR", None)
        else:
            os.environ["FULCRUM_CACHE_DIR"] = old


def test_mixed_k_quants_equal_dequantized_engine_and_transformers(kquant_gguf) -> None:
    from safetensors import safe_open

    from model_factory import hf_greedy

    path, converted = kquant_gguf
    llm = LLM(path, device="cpu", quantization="gguf", max_model_len=256)
    layers = llm.core.runner.model.model.layers
    names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
             "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}  # fmt: skip
    with safe_open(f"{converted}/model.safetensors", framework="pt") as fh:
        for i, want_parts in PARTS.items():
            for proj, kinds in want_parts.items():
                mod = layers[i].self_attn if proj in ("qkv_proj", "o_proj") else layers[i].mlp
                lin = getattr(mod, proj)
                assert isinstance(lin, GgufLinear)
                assert [p.type_name for p in lin.parts] == kinds, (i, proj)
                sub = "self_attn" if mod is layers[i].self_attn else "mlp"
                want = torch.cat(
                    [fh.get_tensor(f"model.layers.{i}.{sub}.{n}.weight") for n in names[proj]]
                )
                assert torch.equal(lin.dequantized_weight(), want), (i, proj)
    prompts = [[1, 504, 3458, 314, 216], list(range(40, 75))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    ref = LLM(path, device="cpu", max_model_len=256).generate(prompts, sp, use_tqdm=False)
    assert packed == [o.outputs[0].token_ids for o in ref]
    assert packed == hf_greedy(converted, prompts, 8)
    assert all(len(set(p)) > 4 for p in packed)  # the random model does not repeat one token


def test_unsupported_type_is_named(tmp_path) -> None:
    from fulcrum.model.loader.gguf_loader import iter_gguf_packed
    from gguf_kquant_writer import write_tiny_llama

    path = str(tmp_path / "q5_0.gguf")
    write_tiny_llama(path, {(1, "ffn_up"): "Q5_0"}, seed=1)
    cfg = types.SimpleNamespace(model_type="llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"'blk.1.ffn_up.weight' \(model.layers.1.mlp.up_proj."
                       r"weight\) has type Q5_0; packed GGUF supports Q4_0, Q4_1, Q8_0, Q4_K"):  # fmt: skip
        list(iter_gguf_packed(path, cfg))


def test_missing_or_misshapen_shards_are_named() -> None:
    import numpy as np

    from fulcrum.quant.gguf import GgufBlocks

    lin = GgufLinear(256, 32, bias=False)
    lin.check_format("model.layers.0.mlp.gate_up_proj")
    blocks = GgufBlocks("Q4_K", np.zeros((16, 144), np.uint8), 16, 256)
    with pytest.raises(ValueError, match=r"gate_up_proj: GGUF tensor of shape \(16, 256\), "
                       r"expected \(8, 256\)"):  # fmt: skip
        lin.load_packed("blocks", blocks, (16, 8))
    assert lin.load_packed("blocks", blocks, (16, 16))
    with pytest.raises(ValueError, match="gate_up_proj: GGUF shards leave output features 0..16"):
        lin.finish_loading()
    lin.load_packed("blocks", blocks, (0, 16))
    lin.finish_loading()
    assert [p.type_name for p in lin.parts] == ["Q4_K"] and lin.dequantized_weight().shape == (
        32,
        256,
    )


def test_packed_load_writes_no_dequantized_copy(tmp_path, monkeypatch) -> None:
    """A packed load reads the file itself: the cache gets config and tokenizer, not the float32
    weights (32 GB for an 8B model); a dequantized load writes them once."""
    from gguf_kquant_writer import write_tiny_llama

    monkeypatch.setenv("FULCRUM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama(path, TYPES, seed=1)
    LLM(path, device="cpu", quantization="gguf", max_model_len=64)
    (cache,) = (tmp_path / "cache" / "gguf").iterdir()
    assert (cache / "config.json").is_file() and not (cache / "model.safetensors").exists()
    LLM(path, device="cpu", max_model_len=64)
    assert (cache / "model.safetensors").is_file()
