"""W4A16 GEMV and GEMM (``kernels/w4a16.py``) against dequantize-then-matmul at Llama-3.1-8B
linear-layer shapes on CUDA (bf16 activations, INT4 group 128; 8-bit and act-order once), and
an INT4 engine on dummy packed weights generating."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: on the CPU they must be defined in interpreter mode,
    # which tests/kernels/conftest.py switches on, and this module may be collected first.
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum.kernels import w4a16, w4a16_common, w4a16_gemv  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv .. down


def _weight(n: int, k: int, group: int, bits: int = 4):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    pack = 32 // bits
    qw = torch.randint(-(2**31), 2**31 - 1, (k // pack, n), dtype=torch.int32, device="cuda",
                       generator=gen)  # fmt: skip
    zeros = torch.randint(0, 1 << bits, (k // group, n), dtype=torch.uint8, device="cuda",
                          generator=gen)  # fmt: skip
    scales = (torch.rand(k // group, n, device="cuda", generator=gen) * 0.004 + 1e-4).half()
    return qw, zeros, scales


def _check(y: torch.Tensor, want: torch.Tensor) -> None:
    err = (y.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 1e-2, err


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gemv_8b_shapes(n: int, k: int, m: int) -> None:
    qw, z, s = _weight(n, k, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = w4a16_common.reference_matmul(x.float(), qw, z, s, b, 128, 4)
    _check(w4a16_gemv.gemv(x, qw, z, s, b, 128), want)


@pytest.mark.parametrize("m", [1, 3, 64])
def test_split_k_in_graph_replays_bit_exact(m: int) -> None:
    """Split-K's in-kernel sum (the strip's last program) replayed from a CUDA graph, layers
    back to back on one stream: every replay equals the eager result bit for bit, so the
    counters are back at zero after each launch and the partials read are this launch's."""
    n, k = SHAPES[3]
    layers = [_weight(n, k, 128) for _ in range(2)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    if m == 64:
        fn, cfg = w4a16.gemm, w4a16.GEMM_CONFIG + (0, 8)
    else:
        fn, cfg = w4a16_gemv.gemv, (w4a16_gemv.GEMV1_CONFIG if m == 1 else w4a16_gemv.GEMV_CONFIG) + (16,)

    def run() -> torch.Tensor:
        y = x
        for qw, z, s in layers:  # down_proj's K is 14,336: feed its output back, padded
            y = fn(torch.nn.functional.pad(y, (0, k - y.shape[1])), qw, z, s, b, 128, config=cfg)
        return y

    want = run()
    _check(want, w4a16_common.reference_matmul(
        torch.nn.functional.pad(w4a16_common.reference_matmul(x.float(), *layers[0], b, 128, 4).bfloat16(),
                                (0, k - n)).float(), *layers[1], b, 128, 4))  # fmt: skip
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = run()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        want = run()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [16, 300, 2048])
def test_gemm_8b_shapes(n: int, k: int, m: int) -> None:
    qw, z, s = _weight(n, k, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = w4a16_common.reference_matmul(x.float(), qw, z, s, None, 128, 4)
    _check(w4a16.gemm(x, qw, z, s, None, 128), want)


@pytest.mark.parametrize("n,k", SHAPES[2:])
@pytest.mark.parametrize("m", [16, 136, 2048])
def test_swapped_gemm_and_dense_path_8b_shapes(n: int, k: int, m: int) -> None:
    """``kernel_config.int_gemm``'s paths: the GEMM with swapped operands (the engine's launch
    config for ``m``) and dequantize + cuBLAS."""
    qw, z, s = _weight(n, k, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = w4a16_common.reference_matmul(x.float(), qw, z, s, b, 128, 4)
    _check(w4a16.linear(x, qw, z, s, b, 128, 4, few=False, swap_ab=True), want)
    _check(w4a16.linear(x, qw, z, s, b, 128, 4, few=False, dense_rows=m), want)


@pytest.mark.parametrize("fn", [w4a16_gemv.gemv, w4a16.gemm])
def test_8bit_and_one_group(fn) -> None:
    for bits, group in ((8, 128), (4, 4096)):
        qw, z, s = _weight(4096, 4096, group, bits)
        x = torch.randn(3 if fn is w4a16_gemv.gemv else 64, 4096, device="cuda", dtype=torch.bfloat16)
        _check(
            fn(x, qw, z, s, None, group, bits),
            w4a16_common.reference_matmul(x.float(), qw, z, s, None, group, bits),
        )


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_engine_on_dummy_packed_weights(tmp_path, method: str) -> None:
    """A small Llama shape with dummy INT4 weights: CUDA graphs, the GEMV (decode) and the
    GEMM (prefill) in one run; the engine generates the requested tokens."""
    import json

    from fulcrum import LLM, SamplingParams

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path), load_format="dummy", quantization=method, max_model_len=256, num_kv_blocks=64
    )
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    out = llm.generate([[1, 2, 3], list(range(5, 200))], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]


@pytest.mark.parametrize("method,act", [("gptq", True), ("awq", False)])
def test_int4_checkpoint_close_to_dequantized_bf16(tiny_models, tmp_path, method, act) -> None:
    """A tiny GPTQ (act-order) / AWQ checkpoint on CUDA in bf16 -- the W4A16 GEMV for decode,
    the GEMM for prefill -- against the same engine on the dequantized weights in bf16: at the
    first divergence each side's token is in the other's top-5."""
    from fulcrum import LLM, SamplingParams
    from int_quantizer import write_quantized
    from model_factory import assert_first_divergence_in_top

    dst, ref = str(tmp_path / "q"), str(tmp_path / "ref")
    write_quantized(tiny_models["llama"], dst, ref, method, 4, 32, sym=False, desc_act=act)
    prompts = [list(range(5, 11)), list(range(20, 57))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    res = {}
    for name, path in (("int4", dst), ("ref", ref)):
        # a fixed small pool: KV profiling would count an engine a test before still holds
        outs = LLM(path, dtype="bfloat16", num_kv_blocks=64).generate(prompts, sp, use_tqdm=False)
        res[name] = (
            [o.outputs[0].token_ids for o in outs],
            [[list(d) for d in o.outputs[0].logprobs] for o in outs],
        )
    for i in range(len(prompts)):
        assert_first_divergence_in_top(
            res["int4"][0][i], res["int4"][1][i], res["ref"][0][i], res["ref"][1][i], f"p{i}"
        )
