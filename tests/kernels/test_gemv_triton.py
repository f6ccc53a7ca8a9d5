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


def _norm_ref(h: torch.Tensor, eps: float) -> torch.Tensor:
    """The normalized row in fp32 (not rounded to h's dtype: the fused kernel never rounds it)."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize(
    ("bias", "fp8", "config"),
    [
        (False, False, (8, 16, 1)),  # several K tiles, a ragged last one
        (True, False, (8, 16, 1)),  # bias after the row's scale
        (False, False, (4, 128, 2)),  # one K tile wider than K
        (True, True, (8, 32, 1)),  # an FP8 weight with row scales
    ],
)
def test_norm_gemv_matches_norm_then_linear(bias: bool, fp8: bool, config) -> None:
    """RMSNorm fused into the GEMV: ``(W x) * rsqrt(mean(x^2) + eps) * scale + bias``."""
    from fulcrum.kernels.gemv import norm_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(int(bias) + 2 * int(fp8) + config[1])
    k, n, eps = 72, 21, 1e-5
    x = torch.randn(1, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    out = norm_gemv(x, eps, w, b, config=config, scale=scale)
    wf = w.float() * (scale[:, None] if scale is not None else 1.0)
    torch.testing.assert_close(out, F.linear(_norm_ref(x, eps), wf, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="norm_gemv"):
        norm_gemv(torch.randn(2, k), eps, w)


def test_norm_gemv_bf16_close_to_the_unfused_pair() -> None:
    """bf16: within the unfused norm's rounding of the normalized row of norm-then-GEMV."""
    from fulcrum.kernels.gemv import norm_gemv
    from fulcrum.kernels.rmsnorm import rms_norm_ref

    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 128, generator=g).bfloat16()
    w = (torch.randn(40, 128, generator=g) * 0.05).bfloat16()
    out = norm_gemv(x, 1e-5, w, config=(8, 32, 1))
    assert out.dtype == torch.bfloat16
    unfused = F.linear(rms_norm_ref(x, torch.ones(128).bfloat16(), 1e-5).float(), w.float())
    torch.testing.assert_close(out.float(), unfused, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_adds_the_residual_in_its_epilogue(m: int, dtype: torch.dtype) -> None:
    """``gemv(..., residual=r)``: the product rounded to the dtype, then ``+ r`` rounded, as
    ``F.linear(x, w, b) + r`` rounds it."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 48, generator=g).to(dtype)
    w = (torch.randn(24, 48, generator=g) * 0.1).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    r = torch.randn(m, 24, generator=g).to(dtype)
    out = gemv(x, w, b, config=(8, 16, 1), residual=r)
    ref = (F.linear(x.float(), w.float(), b.float()).to(dtype).float() + r.float()).to(dtype)
    # bf16: a step or two of the operands apart at most (the interpreter casts fp32 -> bf16 by
    # truncation, twice here; CUDA rounds to nearest)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1 / 64)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, residual=r[:, :-1])


def test_fused_norm_layers_match_the_unfused_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder layer's half after attention with the norms fused into its one-row GEMVs
    (the norm folded into gate_up, the residual adds in o_proj's and down's epilogues), with
    and without the activation in gate_up's GEMV, against the same layer unfused; the next
    layer's qkv against norm-then-linear."""
    import fulcrum.model.layers.linear as linear_mod
    from fulcrum.kernels import gemv as gemv_mod
    from fulcrum.model.llama import DecoderLayer, ModelArgs

    a = ModelArgs(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, qkv_bias=True,
        tie_word_embeddings=False, max_position=64,
    )  # fmt: skip
    torch.manual_seed(0)
    layers = [DecoderLayer(a, None, None) for _ in range(2)]
    for layer in layers:
        for p in layer.parameters():
            p.data = torch.randn_like(p) * 0.1
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = torch.rand(64) + 0.5
    o = torch.randn(1, 64)
    residual = torch.randn(1, 64)
    x = torch.randn(1, 64)
    out, res = layers[0].after_attention(o, residual)  # unfused: the add deferred to the norm
    qkv_ref, h_ref = linear_mod.norm_linear(
        layers[1].input_layernorm, layers[1].self_attn.qkv_proj, out, res
    )

    for layer in layers:
        linear_mod.fold_norm(layer.input_layernorm, layer.self_attn.qkv_proj)
        linear_mod.fold_norm(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
    assert torch.equal(layers[0].input_layernorm.weight, torch.ones(64))
    monkeypatch.setattr(gemv_mod, "FUSE_NORM", True)
    monkeypatch.setattr(gemv_mod, "GPU_CONFIG", {k: (8, 32, 1) for k in gemv_mod.GPU_CONFIG})
    monkeypatch.setattr(linear_mod, "use_triton", lambda t: True)  # the interpreter's GEMV
    assert linear_mod.fused_norms(o, layers[0].post_attention_layernorm)
    out_f, res_f = layers[0].after_attention(o, residual)
    assert res_f is None  # the output holds the residual
    torch.testing.assert_close(out_f, out + res, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(gemv_mod, "FUSE_SILU", True)  # and the activation in gate_up's GEMV
    out_s, _ = layers[0].after_attention(o, residual)
    torch.testing.assert_close(out_s, out + res, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(gemv_mod, "FUSE_NORM", False)  # the activation alone
    out_a, res_a = layers[0].after_attention(o, residual)
    torch.testing.assert_close(out_a + res_a, out + res, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(gemv_mod, "FUSE_NORM", True)
    monkeypatch.setattr(gemv_mod, "FUSE_SILU", False)
    qkv_f, h_f = linear_mod.norm_linear(
        layers[1].input_layernorm, layers[1].self_attn.qkv_proj, out_f, None
    )
    assert h_f is out_f
    torch.testing.assert_close(h_f, h_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(qkv_f, qkv_ref, atol=1e-4, rtol=1e-4)
    # the first layer's input: no residual yet, the embedding row itself
    qkv0, h0 = linear_mod.norm_linear(
        layers[0].input_layernorm, layers[0].self_attn.qkv_proj, x, None
    )
    assert h0 is x
    monkeypatch.setattr(gemv_mod, "FUSE_NORM", False)
    unf, _ = linear_mod.norm_linear(
        layers[0].input_layernorm, layers[0].self_attn.qkv_proj, x, None
    )
    torch.testing.assert_close(qkv0, unf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("m", "norm", "fp8", "config"),
    [
        (1, False, False, (4, 16, 1)),  # two output rows per program, ragged K tiles
        (3, False, False, (8, 32, 1)),  # several rows of x, an output not a multiple of 4
        (1, True, False, (8, 16, 1)),  # with the norm of norm_gemv first
        (2, False, True, (4, 32, 1)),  # an FP8 weight: each row's own scale
    ],
)
def test_silu_gemv_matches_gemv_then_activation(m: int, norm: bool, fp8: bool, config) -> None:
    """SiLU-and-mul in the GEMV's epilogue: each program owns matching gate and up rows."""
    from fulcrum.kernels.activation import silu_and_mul
    from fulcrum.kernels.gemv import norm_gemv, silu_gemv
    from fulcrum.quant.fp8 import quantize_rows

    g = torch.Generator().manual_seed(m + 10 * int(norm) + 100 * int(fp8))
    k, i = 40, 13
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * i, k, generator=g) * 0.2
    b = None if fp8 else torch.randn(2 * i, generator=g)
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    out = silu_gemv(x, w, b, config=config, scale=scale, eps=1e-5 if norm else None)
    if norm:
        gate_up = norm_gemv(x, 1e-5, w, b, config=config, scale=scale)
    else:
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
    with pytest.raises(ValueError, match="one row"):
        silu_gemv(torch.randn(2, 64).bfloat16(), w, eps=1e-5)
