from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulcrum.kernels.gemv import MAX_M, gemv
from fulcrum.model.layers.linear import Linear


@pytest.mark.parametrize(
    ("m", "n", "k", "bias", "config"),
    [
        (1, 37, 64, False, None),  # rows not a multiple of the tile
        (3, 16, 100, True, None),  # K not a multiple of the tile, bias
        (4, 9, 33, True, (8, 16, 1)),  # several K tiles, ragged last one
        (2, 64, 256, False, (16, 64, 2)),
        (1, 5, 8, True, (4, 64, 1)),  # one K tile wider than K
        (1, 40, 100, True, (8, 32, 2)),  # one row: elementwise products, one final sum
    ],
)
def test_gemv_matches_linear(m: int, n: int, k: int, bias: bool, config) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = gemv(x, w, b, config=config)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_gemv_bf16_rounds_once() -> None:
    """bf16 inputs: fp32 accumulation, one rounding of the result (as cuBLAS's GEMV)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 96, generator=g).bfloat16()
    w = torch.randn(24, 96, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float()).bfloat16()
    out = gemv(x, w, config=(8, 32, 1))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=1 / 128)


def test_gemv_strided_rows_and_bad_shapes() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 80, generator=g)
    x = base[:, :40]  # row stride 80
    w = torch.randn(12, 40, generator=g)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(MAX_M + 1, 40), w)
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(1, 41), w)


def test_linear_is_nn_linear_off_cuda() -> None:
    """Off CUDA the layer is exactly ``nn.Linear`` (same parameters, same result)."""
    torch.manual_seed(0)
    lin = Linear(32, 8, bias=True)
    ref = torch.nn.Linear(32, 8, bias=True)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(1, 32)
    assert torch.equal(lin(x), ref(x))


@pytest.mark.parametrize("m", [1, 2])
def test_gemv_fp8_weight_with_row_scales(m: int) -> None:
    """An e4m3 weight with one fp32 scale per row: ``(x @ q.T) * scale + bias``."""
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, 64, generator=g)
    w = torch.randn(20, 64, generator=g) * 0.05
    b = torch.randn(20, generator=g)
    q, s = quantize_rows(w)
    out = gemv(x, q, b, config=(8, 16, 1), scale=s)
    ref = F.linear(x, q.float()) * s + b
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # and close to the full-precision product (e4m3 keeps ~2 significant digits)
    assert (out - F.linear(x, w, b)).abs().max() < 0.05 * F.linear(x, w).abs().max() + 0.01


def _tiny_layer(rope=None, backend=None, quant=None):
    """A one-layer Llama decoder (4 heads over 2 kv heads of 16, qkv bias) with random weights
    (``quant``: its projections packed by that method, random packed words)."""
    from fulcrum.model.llama import DecoderLayer, ModelArgs

    a = ModelArgs(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, qkv_bias=True,
        tie_word_embeddings=False, max_position=64,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = DecoderLayer(a, rope, backend, quant)
    for p in layer.parameters():
        if p.is_floating_point():
            p.data = torch.randn_like(p) * 0.1
    for m in layer.modules():
        if hasattr(m, "init_dummy"):
            m.init_dummy(torch.Generator().manual_seed(1))
    return layer


def _on_the_interpreters_gemv(monkeypatch, kernel: str) -> list:
    """Linear layers run the GEMV (in the interpreter) as on CUDA; returns a list that gets an
    entry per call of ``gemv.<kernel>``."""
    import fulcrum.model.layers.linear as linear_mod
    from fulcrum.kernels import gemv as gemv_mod

    monkeypatch.setattr(linear_mod, "use_triton", lambda *a: True)
    calls: list = []
    real = getattr(gemv_mod, kernel)
    monkeypatch.setattr(gemv_mod, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_silu_in_the_layer_matches_the_unfused_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder layer's half after attention with SiLU-and-mul in gate_up's one-row GEMV
    (``KernelConfig.gemv.fuse_silu``) against the same layer with the activation as its own
    kernel."""
    from fulcrum.config import KernelConfig
    from fulcrum.kernels.dispatch import set_kernel_config

    layer = _tiny_layer()
    o, residual = torch.randn(1, 64), torch.randn(1, 64)
    out, res = layer.after_attention(o, residual)  # off CUDA: torch throughout
    calls = _on_the_interpreters_gemv(monkeypatch, "silu_gemv")
    for fuse in (True, False):
        set_kernel_config(layer, KernelConfig().replace(gemv={"fuse_silu": fuse}))
        out_f, res_f = layer.after_attention(o, residual)
        torch.testing.assert_close(res_f, res, atol=1e-5, rtol=1e-5)  # o_proj on the GEMV
        torch.testing.assert_close(out_f, out, atol=1e-4, rtol=1e-4)
    assert calls == [1]  # the fused kernel ran once, with the switch on


@torch.inference_mode()
def test_rope_in_the_layer_matches_the_unfused_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder layer's half before attention with rotary and the K/V write in qkv's one-row
    GEMV (``KernelConfig.gemv.fuse_rope``) against the same layer with rotary and the cache
    write done by the attention backend after the projection."""
    from types import SimpleNamespace

    from fulcrum.attention.torch_ref import TorchAttentionBackend
    from fulcrum.config import KernelConfig
    from fulcrum.kernels.dispatch import set_kernel_config
    from fulcrum.model.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 16, 64)
    layer = _tiny_layer(rope, TorchAttentionBackend(4, 2, 16, 0.25))
    x, residual = torch.randn(1, 64), torch.randn(1, 64)
    pos, slots = torch.tensor([37]), torch.tensor([13])
    cache = torch.zeros(2, 8, 4, 2, 16)
    want = layer.before_attention(x, residual, pos, cache, slots)  # off CUDA: torch throughout
    assert cache[:, 3, 1].abs().sum() > 0  # slot 13 = block 3, offset 1
    calls = _on_the_interpreters_gemv(monkeypatch, "rope_gemv")
    for fuse in (True, False):
        set_kernel_config(layer, KernelConfig().replace(gemv={"fuse_rope": fuse}))
        got_cache = torch.zeros_like(cache)
        got = layer.before_attention(x, residual, pos, got_cache, slots)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_cache, cache, atol=1e-5, rtol=1e-5)
    assert calls == [1]  # the fused kernel ran once, with the switch on


@torch.inference_mode()
def test_int4_epilogues_in_the_layer_match_the_unfused_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPTQ layer at one row: rotary + the K/V write in qkv's one-row kernel and SiLU-and-mul
    in gate_up's (``gemv.fuse_rope`` / ``fuse_silu``) against the same layer with those as
    their own kernels, both halves of the layer, cache included."""
    from types import SimpleNamespace

    import fulcrum.quant.int4 as int4_mod
    from fulcrum.attention.torch_ref import TorchAttentionBackend
    from fulcrum.config import KernelConfig
    from fulcrum.kernels import w4a16_gemv
    from fulcrum.kernels.dispatch import set_kernel_config
    from fulcrum.model.layers.rotary import RotaryEmbedding
    from fulcrum.quant.int4 import GptqMethod

    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 16, 64)
    quant = GptqMethod({"bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    layer = _tiny_layer(rope, TorchAttentionBackend(4, 2, 16, 0.25), quant)
    x, residual, o = torch.randn(1, 64), torch.randn(1, 64), torch.randn(1, 64)
    pos, slots = torch.tensor([37]), torch.tensor([13])
    _on_the_interpreters_gemv(monkeypatch, "gemv")  # use_triton on in the linear layers
    monkeypatch.setattr(int4_mod, "use_triton", lambda *a: True)
    calls: list = []
    for name in ("silu_gemv1", "rope_gemv1"):
        real = getattr(w4a16_gemv, name)
        monkeypatch.setattr(w4a16_gemv, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    got = {}
    for fuse in (True, False):
        set_kernel_config(layer, KernelConfig().replace(gemv={"fuse_rope": fuse, "fuse_silu": fuse}))
        cache = torch.zeros(2, 8, 4, 2, 16)
        got[fuse] = (layer.before_attention(x, residual, pos, cache, slots), cache,
                     layer.after_attention(o, residual))  # fmt: skip
    (q1, k1, v1, r1), c1, (out1, res1) = got[True]
    (q0, k0, v0, r0), c0, (out0, res0) = got[False]
    for a, b in ((q1, q0), (k1, k0), (v1, v0), (r1, r0), (c1, c0), (out1, out0), (res1, res0)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert c1[:, 3, 1].abs().sum() > 0  # slot 13 = block 3, offset 1
    assert calls == ["rope_gemv1", "silu_gemv1"]  # each fused kernel once, with the switches on


@pytest.mark.parametrize(
    ("m", "fp8", "config"),
    [
        (1, False, (4, 16, 1)),  # two output rows per program, ragged K tiles
        (3, False, (8, 32, 1)),  # several rows of x, an output not a multiple of 4
        (1, False, (8, 16, 1)),
        (2, True, (4, 32, 1)),  # an FP8 weight: each row's own scale
    ],
)
def test_silu_gemv_matches_gemv_then_activation(m: int, fp8: bool, config) -> None:
    """SiLU-and-mul in the GEMV's epilogue: each program owns matching gate and up rows."""
    from fulcrum.kernels.activation import silu_and_mul
    from fulcrum.kernels.gemv import silu_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(m + config[0] + 100 * int(fp8))
    k, i = 40, 13
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * i, k, generator=g) * 0.2
    b = None if fp8 else torch.randn(2 * i, generator=g)
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    out = silu_gemv(x, w, b, config=config, scale=scale)
    gate_up = gemv(x, w, b, config=config, scale=scale)
    assert out.shape == (m, i)
    torch.testing.assert_close(out, silu_and_mul(gate_up), atol=1e-5, rtol=1e-5)


def test_silu_gemv_bf16_and_bad_shapes() -> None:
    from fulcrum.kernels.activation import silu_and_mul
    from fulcrum.kernels.gemv import silu_gemv

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, generator=g).bfloat16()
    w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
    out = silu_gemv(x, w, config=(4, 32, 1))
    assert out.dtype == torch.bfloat16
    ref = silu_and_mul(gemv(x, w, config=(4, 32, 1)))
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1 / 64)
    with pytest.raises(ValueError, match="gate and up"):
        silu_gemv(x, w[:-1])


@pytest.mark.parametrize(
    ("m", "dtype", "cache_dtype", "config", "bias", "heads"),
    [
        (1, torch.float32, torch.float32, (4, 16, 1), False, (4, 2, 16)),  # 2 pairs a program
        (3, torch.float32, torch.float32, (8, 32, 1), True, (4, 2, 16)),  # a padding slot
        (1, torch.bfloat16, torch.bfloat16, (4, 32, 1), True, (4, 2, 16)),  # rounds as the two
        (2, torch.bfloat16, torch.float8_e4m3fn, (2, 64, 1), False, (4, 2, 16)),  # V token-major
        (1, torch.float32, torch.float32, (8, 16, 1), True, (3, 1, 10)),  # last program ragged
    ],
)
def test_rope_gemv_matches_gemv_then_rotary_and_cache_write(
    m, dtype, cache_dtype, config, bias, heads
):
    """The qkv projection with rotary and the K/V write in its epilogue against ``gemv`` then
    ``apply_rotary(..., kv_write=...)``: same qkv output, same cache bytes."""
    from paged_batch import make_paged_batch

    from fulcrum.kernels.gemv import rope_gemv
    from fulcrum.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(m + config[0])
    (hq, hkv, d), k = heads, 48
    cache, meta = make_paged_batch([9, 1, 23], [1, 1, 1], hkv, d, 4, generator=g)
    cache = (cache * 0.5).to(cache_dtype)
    slots = meta.slot_mapping[:m].clone()
    if m == 3:
        slots[1] = -1  # a padding row: its K/V are not written
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) * 0.3).to(dtype)
    b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
    pos = torch.randint(0, 60, (m,), generator=g)
    inv = 1.0 / 500.0 ** (torch.arange(0, d, 2).float() / d)
    f = torch.outer(torch.arange(64).float(), inv)
    cs = torch.cat([f.cos(), f.sin()], -1)

    want_cache = cache.clone()
    want = gemv(x, w, b, config=config)
    q, kk, v = want.view(m, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary(q, kk, pos, cs, kv_write=(v, want_cache, slots))
    got_cache = cache.clone()
    got = rope_gemv(x, w, pos, cs, got_cache, slots, hq, hkv, bias=b, config=config)
    assert torch.equal(got, want)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(got_cache.view(torch.uint8), cache.view(torch.uint8))  # it wrote
    with pytest.raises(ValueError, match="rope_gemv"):
        rope_gemv(x, w[:-d], pos, cs, got_cache, slots, hq, hkv, config=config)


@pytest.mark.parametrize(
    ("n", "k", "config", "dtype"),
    [
        (20, 64, (8, 16, 1), torch.float32),
        (13, 72, (4, 32, 1), torch.float32),  # ragged rows and K tiles
        (6, 68, (2, 64, 1), torch.bfloat16),
    ],
)
def test_gemv_fp8_words_match_the_byte_path(n: int, k: int, config, dtype) -> None:
    """One row of an e4m3 weight read as int32 words of four weights (``_e4m3_words``): the
    same sums as widening byte by byte, for plain, SiLU and rotary epilogues."""
    from fulcrum.kernels.activation import silu_and_mul
    from fulcrum.kernels.gemv import reads_words, silu_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    q, s = quantize_rows(torch.randn(2 * n, k, generator=g) * 0.1)
    b = torch.randn(2 * n, generator=g).to(dtype)
    assert reads_words(x, q) and not reads_words(x.expand(2, k), q)
    assert not reads_words(x[:, 1:], q[:, 1:])  # rows not whole words: the byte path
    words = gemv(x, q, b, config=config, scale=s)
    ref = F.linear(x.float(), q.float()) * s + b.float()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1 / 64)
    torch.testing.assert_close(words.float(), ref, **tol)
    torch.testing.assert_close(words, gemv(x, q, b, config=config, scale=s, fp8_words=False))
    fused = silu_gemv(x, q, config=config, scale=s)
    torch.testing.assert_close(fused, silu_and_mul(gemv(x, q, config=config, scale=s)))


def test_rope_gemv_fp8_words_match_the_byte_path() -> None:
    """The qkv projection of an e4m3 weight with rotary and the K/V write in its epilogue:
    the word path writes the same output and cache as the byte path."""
    from paged_batch import make_paged_batch

    from fulcrum.kernels.gemv import rope_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(3)
    (hq, hkv, d), k = (4, 2, 16), 64
    cache, meta = make_paged_batch([9, 1, 23], [1, 1, 1], hkv, d, 4, generator=g)
    x = torch.randn(1, k, generator=g)
    q, s = quantize_rows(torch.randn((hq + 2 * hkv) * d, k, generator=g) * 0.3)
    pos = torch.tensor([17])
    inv = 1.0 / 500.0 ** (torch.arange(0, d, 2).float() / d)
    f = torch.outer(torch.arange(64).float(), inv)
    cs = torch.cat([f.cos(), f.sin()], -1)
    outs = []
    for words in (True, False):
        c = cache.clone()
        y = rope_gemv(x, q, pos, cs, c, meta.slot_mapping, hq, hkv, None, (4, 32, 1), s,
                      fp8_words=words)  # fmt: skip
        outs.append((y, c))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][1], cache)  # the K/V rows were written
