"""Every bad input raises a ValueError whose message names the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fulcrum import LLM, SamplingParams
from model_factory import edited_copy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(logprobs=21), "logprobs"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", device="cpu", max_model_len=64)


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match="prompt.*max_model_len=64"):
        tiny_llm.generate([[5] * 80], use_tqdm=False)
    # The engine is still usable afterwards.
    out = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_token_ids_outside_vocabulary(tiny_llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate([[5, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate([[-1, 5]], use_tqdm=False)


def test_string_prompt_without_tokenizer(tiny_llm):
    with pytest.raises(ValueError, match="prompt"):
        tiny_llm.generate("hello", use_tqdm=False)


def test_unknown_architecture(tiny_models, tmp_path):
    d = tmp_path / "gpt"
    shutil.copytree(tiny_models["llama"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architectures.*GPTNeoForCausalLM"):
        LLM(str(d), device="cpu")


def test_missing_and_corrupt_weights(tiny_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], d)
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    os.remove(d / shard)
    with pytest.raises(ValueError, match="model weights.*missing"):
        LLM(str(d), device="cpu")
    d2 = tmp_path / "m2"
    shutil.copytree(tiny_models["mistral"], d2)
    (d2 / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model weights"):
        LLM(str(d2), device="cpu")
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")


def test_unknown_llm_argument():
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(max_num_seq=4)





@pytest.mark.parametrize(
    "arch, fields, field",
    [
        ("mistral", dict(layer_types=["chunked_attention"] * 2), "layer_types"),
        (
            "qwen3",
            dict(use_sliding_window=True, sliding_window=-4, max_window_layers=0, layer_types=None),
            "sliding_window",
        ),
        ("llama", dict(rope_parameters={"rope_type": "nonsense", "rope_theta": 1e4}), "rope_"),
        ("phi3", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ],
)
def test_unhandled_config_fields_fail_at_load(tiny_models, tmp_path, arch, fields, field):
    d = edited_copy(tiny_models[arch], tmp_path / arch, **fields)
    with pytest.raises(ValueError, match=field):
        LLM(d, device="cpu", max_model_len=64)
