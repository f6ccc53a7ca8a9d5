"""Tensor parallelism on CUDA (NCCL, two GPUs): decode graphs and piecewise graphs capture the
all-reduces; greedy tokens agree with tp=1 by the bf16 rule (at the first difference each
side's token is in the other's top 5)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

from fulcrum import LLM, SamplingParams  # noqa: E402
from model_factory import assert_first_divergence_in_top  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(3, 60)), [4] * 20 + [100, 200, 300]]


def _run(llm: LLM, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    tops = [
        [[t for t, lp in d.items() if lp.rank <= 5] for d in o.outputs[0].logprobs] for o in outs
    ]
    return toks, tops


@pytest.mark.parametrize("quantization", ["none", "fp8", "gptq"])
def test_tp2_agrees_with_tp1(tiny_models, tmp_path, quantization):
    """gptq: a 4-bit act-order checkpoint (group 32, asymmetric), whose row-parallel slices
    are regrouped (quant/int_regroup.py) for the W4A16 kernels."""
    path = tiny_models["qwen2"]
    if quantization == "gptq":
        from int_quantizer import write_quantized

        path, ref = str(tmp_path / "gptq"), str(tmp_path / "ref")
        write_quantized(tiny_models["qwen2"], path, ref, "gptq", 4, 32, sym=False, desc_act=True)
    kw = dict(quantization=quantization, gpu_memory_utilization=0.3, max_num_seqs=8)
    one = LLM(path, **kw)
    ref, ref_top = _run(one, PROMPTS)
    del one
    torch.cuda.empty_cache()
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert llm.core.runner.use_cuda_graphs  # captured with the NCCL collectives inside
        got, got_top = _run(llm, PROMPTS)
        for i in range(len(PROMPTS)):
            assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"prompt {i}")
    finally:
        llm.core.shutdown()


def test_more_ranks_than_gpus_refused(tiny_models):
    n = torch.cuda.device_count() * 2
    with pytest.raises(ValueError, match=f"tensor_parallel_size={n} needs {n} GPUs"):
        LLM(tiny_models["llama"], tensor_parallel_size=n)
