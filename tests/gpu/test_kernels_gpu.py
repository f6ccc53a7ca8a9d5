"""Triton kernels against their torch references at Llama-3.1-8B shapes, on CUDA.

32 query heads, 8 kv heads, head_dim 128, page 16, contexts up to 4k, batch 64; bf16 and fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing the kernels: on the CPU they must be defined in interpreter mode,
    # which tests/kernels/conftest.py switches on, and this module may be collected first.
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from paged_batch import make_paged_batch  # noqa: E402

import fulcrum.kernels.decode_attention as decode_mod  # noqa: E402
import fulcrum.kernels.prefill_attention as prefill_mod  # noqa: E402
from fulcrum.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from fulcrum.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from fulcrum.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from fulcrum.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from fulcrum.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_ref,
)
from fulcrum.kernels.reshape_and_cache import (  # noqa: E402
    reshape_and_cache,
    reshape_and_cache_ref,
)
from fulcrum.kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from fulcrum.kernels.rotary import apply_rotary, apply_rotary_ref  # noqa: E402

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPES = [torch.bfloat16, torch.float32]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}


def _gen(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_llama8b(dtype: torch.dtype) -> None:
    g = _gen(0)
    seq_lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    seq_lens[:3] = [1, 4096, 16]
    cache, meta = make_paged_batch(
        seq_lens, [1] * 64, HKV, D, PAGE, dtype=dtype, device="cuda", generator=g
    )
    q = torch.randn(64, HQ, D, device="cuda", dtype=dtype)
    out = decode_attention(q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
    ref = decode_attention_ref(q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_llama8b(dtype: torch.dtype) -> None:
    g = _gen(1)
    seq_lens = [2048, 4096, 700, 3000, 33, 1, 1500]
    query_lens = [2048, 1000, 1, 512, 33, 1, 7]
    cache, meta = make_paged_batch(
        seq_lens, query_lens, HKV, D, PAGE, dtype=dtype, device="cuda", generator=g
    )
    q = torch.randn(meta.num_tokens, HQ, D, device="cuda", dtype=dtype)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    out = prefill_attention(*args, meta.max_query_len, D**-0.5)
    ref = prefill_attention_ref(*args, D**-0.5)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch_llama8b(dtype: torch.dtype) -> None:
    g = _gen(2)
    seq_lens = [3000, 1, 257, 4096, 900, 64] + [1000] * 10
    query_lens = [256, 1, 257, 1, 100, 1] + [1] * 10
    cache, meta = make_paged_batch(
        seq_lens,
        query_lens,
        HKV,
        D,
        PAGE,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=5,
        generator=g,
    )
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, D, device="cuda", dtype=dtype) for h in (HQ, HKV, HKV))
    ref_cache = cache.clone()
    out = TritonAttentionBackend(HQ, HKV, D, D**-0.5).forward(q, k, v, cache, meta)
    ref = TorchAttentionBackend(HQ, HKV, D, D**-0.5).forward(q, k, v, ref_cache, meta)
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out[: t - 5], ref[: t - 5], **_tol(dtype))


def test_backend_decode_cuda_graph_replay() -> None:
    """Capture one pure-decode step, change lengths and tables in place, replay, compare."""
    g = _gen(3)
    b, dtype = 64, torch.bfloat16
    cache, meta = make_paged_batch(
        [4096] * b, [1] * b, HKV, D, PAGE, dtype=dtype, device="cuda", generator=g
    )
    backend = TritonAttentionBackend(HQ, HKV, D, D**-0.5)
    q, k, v = (torch.randn(b, h, D, device="cuda", dtype=dtype) for h in (HQ, HKV, HKV))
    backend.forward(q, k, v, cache, meta)  # eager warm-up: compiles and sizes the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta)
    new_lens = torch.randint(1, 4097, (b,), generator=g, dtype=torch.int32)
    meta.seq_lens.copy_(new_lens)
    meta.block_tables.copy_(meta.block_tables[torch.randperm(b, generator=g)])
    slots = [
        int(meta.block_tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE
        for i, n in enumerate(new_lens.tolist())
    ]
    meta.slot_mapping.copy_(torch.tensor(slots))
    for x in (q, k, v):
        x.normal_()
    graph.replay()
    ref = decode_attention_ref(q, cache, meta.block_tables, meta.seq_lens, D**-0.5)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_llama8b(dtype: torch.dtype) -> None:
    g = _gen(4)
    cache, meta = make_paged_batch(
        [4000, 17, 2048],
        [4000, 1, 1024],
        HKV,
        D,
        PAGE,
        dtype=dtype,
        device="cuda",
        num_pad_tokens=8,
        generator=g,
    )
    k, v = (torch.randn(meta.num_tokens, HKV, D, device="cuda", dtype=dtype) for _ in "kv")
    ref = cache.clone()
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    reshape_and_cache_ref(k, v, ref, meta.slot_mapping)
    assert torch.equal(cache, ref)

    # Rotary fused with the write (the Triton backend's rope_and_write_kv), bf16/fp32 and FP8.
    for kv_dtype in (dtype, FP8):
        t = meta.num_tokens
        qkv = torch.randn(t, HQ + 2 * HKV, D, device="cuda", dtype=dtype)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        cs = torch.randn(8192, D, device="cuda")
        fused, unfused = cache.to(kv_dtype), cache.to(kv_dtype)
        want = qkv.clone()
        q, k, v = want[:, :HQ], want[:, HQ : HQ + HKV], want[:, HQ + HKV :]
        apply_rotary(q, k, pos, cs)
        reshape_and_cache(k, v, unfused, meta.slot_mapping)
        q, k, v = qkv[:, :HQ], qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
        apply_rotary(q, k, pos, cs, kv_write=(v, fused, meta.slot_mapping))
        assert torch.equal(qkv, want)
        assert torch.equal(fused.view(torch.uint8), unfused.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_kernels_llama8b(dtype: torch.dtype) -> None:
    _gen(5)
    t, hidden, inter = 300, 4096, 14336
    x = torch.randn(t, hidden, device="cuda", dtype=dtype)
    res = torch.randn(t, hidden, device="cuda", dtype=dtype)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **_tol(dtype))
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **_tol(dtype))

    gu = torch.randn(t, 2 * inter, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(gu), silu_and_mul_ref(gu), **_tol(dtype))

    qkv = torch.randn(t, HQ + 2 * HKV, D, device="cuda", dtype=dtype)
    q, k = qkv[:, :HQ], qkv[:, HQ : HQ + HKV]
    pos = torch.randint(0, 8192, (t,), device="cuda")
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D)
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), pos, cache)
    out_q, out_k = apply_rotary(q, k, pos, cache)
    torch.testing.assert_close(out_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(out_k, ref_k, **_tol(dtype))


FP8 = torch.float8_e4m3fn


def test_fp8_cache_kernels_llama8b() -> None:
    """FP8 KV cache at real shapes: writes round like torch's conversion (and saturate), decode
    and prefill read the same FP8 values as the fp32 references."""
    g = _gen(6)
    cache, meta = make_paged_batch(
        [4000, 17, 2048, 1000], [4000, 1, 1024, 1], HKV, D, PAGE, device="cuda", generator=g
    )
    cache = cache.to(FP8)
    t = meta.num_tokens
    k, v = (torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16) * 3 for _ in "kv")
    k[0, 0, :2] = torch.tensor([1e4, -1e4], device="cuda")
    ref = cache.clone()
    reshape_and_cache(k, v, cache, meta.slot_mapping)
    reshape_and_cache_ref(k, v, ref, meta.slot_mapping)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    want = prefill_attention_ref(*args, D**-0.5)
    try:
        for widen16 in (True, False):  # tiles widened to fp16 (the default) or to bf16
            prefill_mod.FP8_TO_FP16 = widen16
            out = prefill_attention(*args, meta.max_query_len, D**-0.5)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    finally:
        prefill_mod.FP8_TO_FP16 = True
    dec_rows = meta.query_start_loc[1:][[1, 3]] - 1
    dec_args = (q[dec_rows], cache, meta.block_tables[[1, 3]], meta.seq_lens[[1, 3]], D**-0.5)
    want = decode_attention_ref(*dec_args)
    mode0 = decode_mod.FP8_MODE
    try:
        for mode in ("widen", "fp16"):  # exact widenings: as close as the bf16 path
            decode_mod.FP8_MODE = mode
            torch.testing.assert_close(decode_attention(*dec_args), want, atol=2e-2, rtol=2e-2)
        decode_mod.FP8_MODE = "fp8"  # FP8 query and weights: FP8-level error
        dec = decode_attention(*dec_args)
    finally:
        decode_mod.FP8_MODE = mode0
    err = (dec.float() - want.float()).norm() / want.float().norm()
    assert err < 0.05, f"relative error {err:.4f}"


def test_pdl_modes() -> None:
    from fulcrum.config import PdlConfig
    from fulcrum.kernels import pdl

    x = torch.empty(1, device="cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        assert pdl.mode(x, 1) == pdl.OFF
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    after = PdlConfig(enabled=True, pre_release=False)
    assert pdl.mode(x, sms, after) == pdl.EARLY  # the whole grid is resident: release early
    assert pdl.mode(x, sms + 1, after) == pdl.WAIT
    assert pdl.mode(x, sms + 1, after, early=True) == pdl.EARLY  # the GEMV's grid, any size
    pre = PdlConfig(enabled=True, pre_release=True)
    assert pdl.mode(x, sms, pre) == pdl.PRE  # released before the wait
    assert pdl.mode(x, sms + 1, pre) == pdl.WAIT
    assert pdl.mode(x, 100 * sms, pre, early=True) == pdl.PRE
    assert pdl.mode(x, 2 * sms, PdlConfig(enabled=True, early_max_waves=2)) == pdl.PRE
    assert pdl.mode(x, 1, PdlConfig(enabled=False)) == pdl.OFF


def test_fp8_weight_gemm_llama8b() -> None:
    """Per-token FP8 quantization (Triton) and the FP8 linear layer at Llama-3.1-8B shapes:
    the kernel against torch (the same e4m3 codes, the same scales), the layer against its
    formula, eagerly and replayed from a CUDA graph."""
    from fulcrum.kernels.quant_fp8 import per_token_quant_fp8, per_token_quant_fp8_ref
    from fulcrum.quant.fp8 import Fp8Linear, quantize_rows

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    _gen(13)
    for t, k in ((1, 4096), (300, 4096), (7, 14336)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * 3
        q, s = per_token_quant_fp8(x)
        rq, rs = per_token_quant_fp8_ref(x)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
        diff = (q.float() - rq.float()).abs()
        assert (diff > 0).float().mean() < 1e-3  # at most a rounding tie apart, rarely
        assert (diff <= rq.float().abs() * 2**-3 + 2**-9).all()
    w = torch.randn(6144, 4096, device="cuda") * 0.02
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    lin = Fp8Linear(4096, 6144, bias=False).cuda()
    lin.weight_loader(w)
    qw, sw = quantize_rows(w)
    qx, sx = per_token_quant_fp8_ref(x)
    want = ((qx.float() * sx) @ (qw.float() * sw[:, None]).T).to(torch.bfloat16)
    torch.testing.assert_close(lin(x), want, rtol=2e-2, atol=2e-2)
    out = lin(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = lin(x)
    x.copy_(x * 2)
    g.replay()
    torch.testing.assert_close(out, lin(x), rtol=1e-2, atol=1e-2)  # the doubled input, replayed


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_llama8b(m: int, fp8: bool) -> None:
    """The Triton GEMV at the 8B model's linear shapes, against the fp32 product (bf16 inputs,
    bf16 or FP8 weights), with PDL on (the weight's first tile is read before the wait) and
    inside a CUDA graph after the kernel that writes its input."""
    from fulcrum.kernels.gemv import gemv
    from fulcrum.quant.fp8 import quantize_rows

    _gen(11)
    lin = torch.nn.functional.linear
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scale = None
        if fp8:
            w, scale = quantize_rows(w)
        wf = w.float() if scale is None else w.float() * scale[:, None]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if n == 6144 else None
        bf = None if bias is None else bias.float()
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        h, _ = fused_add_rms_norm(x, res, nw, 1e-5)
        out = gemv(h, w, bias, scale=scale)
        torch.testing.assert_close(out.float(), lin(h.float(), wf, bf), atol=2e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        x_static = x.clone()
        with torch.cuda.graph(graph):
            h2, _ = fused_add_rms_norm(x_static, res, nw, 1e-5)
            out2 = gemv(h2, w, bias, scale=scale)
        x_static.copy_(torch.randn_like(x))
        graph.replay()
        h3, _ = fused_add_rms_norm(x_static, res, nw, 1e-5)
        torch.testing.assert_close(out2.float(), lin(h3.float(), wf, bf), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True])
def test_silu_gemv_llama8b(fp8: bool) -> None:
    """gate_up with SiLU-and-mul in its epilogue at the 8B shape, in a CUDA graph after the
    kernel that writes its input (PDL): as the GEMV then the activation kernel."""
    from fulcrum.kernels.gemv import gemv, silu_gemv
    from fulcrum.quant.fp8 import quantize_rows

    _gen(13)
    k = 4096
    w = torch.randn(28672, k, device="cuda", dtype=torch.bfloat16) * 0.02
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    prev = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = gemv(prev, eye)
        act = silu_gemv(x, w, scale=scale)
    prev.copy_(torch.randn_like(prev))
    graph.replay()
    want = silu_and_mul(gemv(x, w, scale=scale))
    torch.testing.assert_close(act, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_gemv_llama8b(cache_dtype: torch.dtype) -> None:
    """qkv with rotary and the K/V write in its epilogue at the 8B shape (Llama-3 scaled
    rotary table), in a CUDA graph after the kernel that writes its input (PDL): the same qkv
    and cache bytes as the GEMV then ``apply_rotary(..., kv_write=...)``."""
    from types import SimpleNamespace

    from fulcrum.kernels.gemv import gemv, rope_gemv
    from fulcrum.kernels.rotary import apply_rotary
    from fulcrum.model.layers.rotary import RotaryEmbedding

    _gen(17)
    k, hq, hkv, d = 4096, 32, 8, 128
    w = torch.randn((hq + 2 * hkv) * d, k, device="cuda", dtype=torch.bfloat16) * 0.02
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    with torch.device("cuda"):
        rope = RotaryEmbedding(SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling), d, 4096)
    cache = (torch.randn(2, 64, 16, hkv, d, device="cuda") * 0.5).to(cache_dtype)
    pos = torch.tensor([1234], device="cuda")
    slots = torch.tensor([37 * 16 + 5], device="cuda")
    prev = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    got_cache, before = cache.clone(), cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = gemv(prev, eye)
        qkv = rope_gemv(x, w, pos, rope.cos_sin_cache, got_cache, slots, hq, hkv)
    prev.copy_(torch.randn_like(prev))
    graph.replay()
    want = gemv(x, w)
    q, kk, v = want.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    own_cache = cache.clone()
    apply_rotary(q, kk, pos, rope.cos_sin_cache, kv_write=(v, cache, slots))
    torch.testing.assert_close(qkv, want, atol=1e-2, rtol=1e-2)
    _, kk, v = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    reshape_and_cache(kk, v, own_cache, slots)  # the cache holds exactly its own k and v
    assert torch.equal(got_cache.view(torch.uint8), own_cache.view(torch.uint8))
    assert not torch.equal(got_cache.view(torch.uint8), before.view(torch.uint8))  # it wrote


@pytest.mark.parametrize("n", [1, 5])
def test_argmax_rows_llama_vocab_in_a_graph(n: int) -> None:
    """The greedy argmax kernel over Llama-3's 128,256-token vocabulary, in a CUDA graph after
    the LM head's GEMV (PDL): torch's argmax of the same logits, ties to the first index."""
    from fulcrum.kernels.argmax import argmax_rows
    from fulcrum.kernels.gemv import gemv

    _gen(19)
    w = torch.randn(128256, 512, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = gemv(h, w) if n <= 4 else h @ w.t()
        ids = argmax_rows(logits)
    h.copy_(torch.randn_like(h))
    graph.replay()
    assert torch.equal(ids, logits.argmax(-1))
    logits[:, 1000] = logits[:, 120000] = 1e4  # a tie across the row: the first wins
    assert torch.equal(argmax_rows(logits), torch.full((n,), 1000, device="cuda"))
