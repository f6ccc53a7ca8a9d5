"""The end-of-turn ids of ``generation_config.json`` stop generation, as they do in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fulcrum import LLM, SamplingParams
from fulcrum.model.loader.hf_config import generation_eos_token_ids


def test_generation_config_eos_ids(tmp_path: Path):
    assert generation_eos_token_ids(str(tmp_path), None) == set()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert generation_eos_token_ids(None, str(tmp_path / "model.gguf")) == {2, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_token_ids(str(tmp_path)) == {5}


def test_generation_stops_on_a_generation_config_eos(tiny_models, tmp_path: Path):
    model = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], model)
    prompt = [[5, 9, 30, 41, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    full = LLM(str(model), dtype="float32", device="cpu").generate(prompt, greedy, use_tqdm=False)
    toks = full[0].outputs[0].token_ids
    assert full[0].outputs[0].finish_reason == "length"
    k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen.get("eos_token_id", 2), toks[k]]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model), dtype="float32", device="cpu")
    out = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == toks[k]
