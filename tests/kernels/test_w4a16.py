"""W4A16 GEMM and GEMV (``kernels/w4a16.py``) against dequantize-then-matmul, in the interpreter
on the CPU (tiny shapes) and compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels import w4a16, w4a16_common, w4a16_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_weight(k: int, n: int, group: int, bits: int, g: torch.Generator):
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    groups = k // group
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).half()
    return w4a16_common.pack_rows(q, bits), zeros.to(torch.uint8), scales, q


def test_pack_roundtrip_and_dequantize() -> None:
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        qw, z, s, q = _random_weight(64, 24, 16, bits, g)
        assert qw.shape == (64 * bits // 32, 24) and qw.dtype == torch.int32
        assert torch.equal(w4a16_common.unpack_rows(qw, bits), q)
        # value by value, from the layout's description
        w = w4a16_common.dequantize(qw, z, s, 16, bits)
        mn = torch.randn(4, 24, generator=g).half()
        assert torch.equal(w4a16_common.dequantize_t(qw, z, s, 16, bits), w.t())
        assert torch.equal(
            w4a16_common.dequantize_t(qw, z, s, 16, bits, mn), w4a16_common.dequantize(qw, z, s, 16, bits, mn).t()
        )
        for k, n in ((0, 0), (13, 5), (63, 23), (40, 17)):
            word = int(qw[k // (32 // bits), n]) & 0xFFFFFFFF
            v = (word >> ((k % (32 // bits)) * bits)) & ((1 << bits) - 1)
            want = (v - int(z[k // 16, n])) * float(s[k // 16, n])
            assert w[k, n].item() == pytest.approx(want, rel=1e-6)


CASES = [  # (m, k, n, group, bits, bias)
    (1, 64, 40, 16, 4, False),
    (2, 64, 40, 32, 4, "mins"),  # GGUF Q4_1's additive term
    (3, 64, 48, 32, 4, True),
    (2, 96, 32, 96, 4, False),  # group -1: one group spanning K (not a multiple of the tile)
    (1, 32, 24, 8, 4, True),  # groups smaller than the K tile
    (4, 64, 32, 16, 8, False),
    # one row: the kernel that takes each group's scale and zero out of its sums
    (1, 64, 40, 32, 8, True),
    (1, 64, 24, 32, 4, "mins"),
    (1, 96, 16, 96, 4, False),  # a group of 96: K tiles of 32
]


def _run(fn, case, seed: int, config=None, tol: float = 1e-5):
    """``fn`` (gemv or gemm) on a random case, on DEVICE, against dequantize-then-matmul."""
    m, k, n, group, bits, bias = case
    gen = torch.Generator().manual_seed(seed)
    qw, z, s, _ = _random_weight(k, n, group, bits, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias is True else None
    mn = torch.randn(k // group, n, generator=gen).half() * 0.01 if bias == "mins" else None
    want = w4a16_common.reference_matmul(x, qw, z, s, b, group, bits, mn)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    args = (to(x), to(qw), to(z), to(s), to(b), group, bits)
    y = fn(*args, config, mins=to(mn))
    torch.testing.assert_close(y.cpu(), want, rtol=tol, atol=tol)
    return args, to(mn)


@pytest.mark.parametrize("case", CASES)
def test_gemv_equals_reference(case) -> None:
    m, k, n = case[:3]
    _run(w4a16_gemv.gemv, case, m * 1000 + k + n)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("case", [(1, 128, 40, 16, 4, True), (3, 128, 24, 32, 4, "mins"),
                                  (2, 128, 32, 16, 8, False)])  # fmt: skip
def test_split_k_gemv_equals_reference(case, split) -> None:
    """K shared out over ``split`` programs per strip, their partial sums added by the strip's
    last program, which leaves the counters at zero: a second launch gives the same output."""
    cfg = (16, 16, 1, split)
    args, mn = _run(w4a16_gemv.gemv, case, split * 1000 + case[0] + case[2], cfg)
    first = w4a16_gemv.gemv(*args, cfg, mins=mn)
    assert not w4a16_common.split_counters(first.device, 1).any()
    torch.testing.assert_close(w4a16_gemv.gemv(*args, cfg, mins=mn), first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="split_k"):
        w4a16_gemv.gemv(*args, (16, 16, 1, 3), mins=mn)


@pytest.mark.parametrize("case", [(20, 128, 40, 16, 4, True), (33, 128, 24, 32, 4, "mins")])
def test_split_k_gemm_equals_reference(case) -> None:
    """The GEMM with K split over 4 programs per output tile, the tile's last program adding
    their partials: equal to the reference, the counters back at zero, run to run identical."""
    cfg = (16, 16, 16, 1, 0, 4)
    args, mn = _run(w4a16.gemm, case, 4000 + case[0], cfg)
    first = w4a16.gemm(*args, cfg, mins=mn)
    assert not w4a16_common.split_counters(first.device, 1).any()
    torch.testing.assert_close(w4a16.gemm(*args, cfg, mins=mn), first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="split_k"):
        w4a16.gemm(*args, (16, 16, 16, 1, 0, 3), mins=mn)


@pytest.mark.parametrize("case", [(1, 128, 40, 32, 4, True), (1, 64, 24, 16, 8, "mins")])
def test_one_row_kernel_equals_the_rows_kernel(case) -> None:
    """Both GEMV kernels on the same row: the one-row kernel (scale and zero applied per tile)
    and the one that dequantizes each weight agree with each other and the reference."""
    args, mn = _run(lambda *a, mins: w4a16_gemv.gemv(*a, mins=mins, one_row=True), case, 7)
    y_rows = w4a16_gemv.gemv(*args, mins=mn, one_row=False)
    y_one = w4a16_gemv.gemv(*args, mins=mn, one_row=True)
    torch.testing.assert_close(y_one, y_rows, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one row"):
        w4a16_gemv.gemv(args[0].repeat(2, 1), *args[1:], mins=mn, one_row=True)


def test_auto_split_fills_the_sms() -> None:
    sms = 132
    assert w4a16_common.auto_split(14336, 128, 128, sms) == 16  # 8B down_proj at a 32-column strip
    assert w4a16_common.auto_split(4096, 128, 128, sms) == 8  # o_proj
    assert w4a16_common.auto_split(2048, 128, 128, sms) == 4  # each split keeps 4 K tiles
    assert w4a16_common.auto_split(4096, 192, 128, sms) == 8  # qkv
    assert w4a16_common.auto_split(4096, 896, 128, sms) == 2  # gate_up: already 896 programs
    assert w4a16_common.auto_split(4096, 2048, 128, sms) == 1
    assert w4a16_common.auto_split(4096 + 128, 128, 128, sms) == 1  # K does not halve into whole tiles
    # the GEMM's rule: one program per SM, at most GEMM_MAX_SPLIT ways (o_proj at 64 rows)
    assert w4a16_common.auto_split(4096, 32, 64, 132, 1, 4, w4a16.GEMM_MAX_SPLIT) == 8
    assert w4a16_common.auto_split(4096, 32, 64, 132, 1, 4, 4) == 4
    assert w4a16_common.auto_split(4096, 224, 64, 132, 1, 4, 8) == 1  # gate_up: 224 tiles already


@pytest.mark.parametrize("case", [(5, 64, 40, 16, 4, True), (17, 48, 32, 48, 4, False),
                                  (9, 32, 24, 8, 8, True), (6, 64, 16, 32, 4, "mins")])  # fmt: skip
def test_gemm_equals_reference(case) -> None:
    m, k, n = case[:3]
    _run(w4a16.gemm, case, m * 1000 + k + n, tol=1e-4)


@pytest.mark.parametrize("case", [(5, 64, 40, 16, 4, True), (9, 32, 24, 8, 8, False),
                                  (6, 64, 16, 32, 4, "mins")])  # fmt: skip
def test_swapped_gemm_and_dense_path_equal_reference(case) -> None:
    """The GEMM with the weight as the MMA's first operand (``swap_ab``), with and without
    split-K, and the dequantize-then-dense-GEMM path: each equals the reference."""
    m, k, n = case[:3]
    swapped = lambda *a, mins: w4a16.gemm(*a, mins=mins, swap_ab=True)  # noqa: E731
    args, mn = _run(swapped, case, 9000 + m, (16, 16, 16, 1), tol=1e-4)
    split = w4a16.gemm(*args, (16, 16, 16, 1, 0, 2), mins=mn, swap_ab=True)
    torch.testing.assert_close(split, w4a16.gemm(*args, (16, 16, 16, 1), mins=mn, swap_ab=True),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    dense = w4a16.dense_linear(*args, mins=mn)
    torch.testing.assert_close(dense, w4a16.gemm(*args, mins=mn), rtol=1e-4, atol=1e-4)
    qw, z, s, group, bits = args[1], args[2], args[3], args[5], args[6]
    w = w4a16.dequantize_dense(qw, z, s, group, bits, torch.float32, mn)
    torch.testing.assert_close(w, w4a16_common.dequantize(qw, z, s, group, bits, mn), rtol=0, atol=0)


def test_dense_scratch_is_shared_and_only_grows() -> None:
    """Every layer's dense path dequantizes into one buffer per device and dtype; a larger
    request adds a buffer and keeps the older one (CUDA graphs may hold its address)."""
    cpu = torch.device("cpu")
    a = w4a16.dense_scratch(1 << 20, torch.float16, cpu)
    b = w4a16.dense_scratch(1 << 10, torch.float16, cpu)
    assert b.data_ptr() == a.data_ptr() and b.numel() == 1 << 10
    c = w4a16.dense_scratch((1 << 20) + 1, torch.float16, cpu)
    assert c.data_ptr() != a.data_ptr()
    assert any(t.data_ptr() == a.data_ptr() for t in w4a16._SCRATCH[(cpu, torch.float16)])
    assert w4a16.dense_scratch(8, torch.float32, cpu).dtype == torch.float32


def test_bad_shapes_are_refused() -> None:
    qw = torch.zeros(8, 16, dtype=torch.int32)
    z = torch.zeros(2, 16, dtype=torch.uint8)
    s = torch.ones(2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not fit"):
        w4a16_gemv.gemv(torch.zeros(1, 60), qw, z, s, None, 32)
    with pytest.raises(ValueError, match="do not fit"):
        w4a16.gemm(torch.zeros(1, 64), qw, z, s, None, 64, bits=3)


@pytest.mark.parametrize("rows", [1, 3, 20])  # the GEMV up to gemv.max_m rows, the GEMM above
def test_layer_dispatch_runs_the_kernels(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """An act-order GPTQ layer through its Triton path (forced on the CPU): x's columns gathered
    into the packed row order, then the GEMV or the GEMM; equal to the dequantized layer."""
    import fulcrum.quant.int4 as int4
    from fulcrum.quant import get_quant_method

    gen = torch.Generator().manual_seed(rows)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False}
    lin = get_quant_method("gptq", qc).linear(32, 24, bias=True)
    k, n, gs = 32, 24, 16
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // gs).to(torch.int32)
    zeros = torch.randint(0, 15, (k // gs, n), generator=gen, dtype=torch.int32)
    lin.load_packed("qweight", w4a16_common.pack_rows(q, 4), None)
    lin.load_packed("qzeros", w4a16_common.pack_rows(zeros.t().contiguous(), 4).t().contiguous(), None)
    lin.load_packed("scales", (torch.rand(k // gs, n, generator=gen) * 0.1).half(), None)
    lin.load_packed("g_idx", g_idx, None)
    lin.bias.data.normal_(generator=gen)
    lin.finish_loading()
    assert lin.perm is not None
    x = torch.randn(rows, k, generator=gen)
    want = x @ lin.dequantized_weight().t() + lin.bias
    called = []
    for name in ("gemv", "gemm"):
        real = getattr(w4a16, name)
        monkeypatch.setattr(w4a16, name, lambda *a, _r=real, _n=name, **kw: called.append(_n) or _r(*a, **kw))
    monkeypatch.setattr(int4, "use_triton", lambda x, kc: True)
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    assert called == ["gemv" if rows <= min(lin.kernel_config.gemv.max_m, 4) else "gemm"]


@pytest.mark.parametrize(("config", "bias"), [((16, 16, 1), False), ((8, 16, 1, 2), True)])
def test_one_row_silu_epilogue_matches_gemv_then_activation(config, bias) -> None:
    """gate_up's one-row GEMV with SiLU-and-mul in its epilogue (a program owns N-columns of
    the gate and the same of up), split-K included: the unfused kernel's output, then the
    activation."""
    from fulcrum.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(3 + len(config))
    k, n, group = 64, 2 * 20, 32
    qw, z, s, _ = _random_weight(k, n, group, 4, g)
    x = torch.randn(1, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, qw, z, s, b)]
    fused = w4a16_gemv.silu_gemv1(*args, group, 4, config=config)
    plain = w4a16_gemv.gemv(*args, group, 4, config, one_row=True)
    assert fused.shape == (1, n // 2)
    torch.testing.assert_close(fused, silu_and_mul(plain), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="gate and up"):
        w4a16_gemv.silu_gemv1(args[0], qw[:, :-1].contiguous(), z[:, :-1].contiguous(),
                              s[:, :-1].contiguous(), None, group, 4)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "cache_dtype", "heads"),
    [((16, 16, 1), torch.float32, (4, 2, 16)),  # one head a program
     ((32, 16, 1, 2), torch.float32, (3, 1, 8)),  # four heads a program, split-K, ragged
     ((16, 16, 1), torch.float8_e4m3fn, (4, 2, 16))],  # FP8 cache: V token-major
)  # fmt: skip
def test_one_row_rope_epilogue_matches_gemv_then_rotary(config, cache_dtype, heads) -> None:
    """qkv's one-row GEMV with rotary and the K/V cache write in its epilogue: the unfused
    kernel's output then ``apply_rotary(..., kv_write=...)``, bit for bit, cache included."""
    from paged_batch import make_paged_batch

    from fulcrum.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(7 + heads[2])
    (hq, hkv, d), k, group = heads, 64, 32
    n = (hq + 2 * hkv) * d
    qw, z, s, _ = _random_weight(k, n, group, 4, g)
    x = torch.randn(1, k, generator=g)
    cache, meta = make_paged_batch([9, 23], [1, 1], hkv, d, 4, generator=g)
    cache = (cache * 0.5).to(cache_dtype)
    slots = meta.slot_mapping[1:2].clone()
    pos = torch.tensor([41])
    inv = 1.0 / 500.0 ** (torch.arange(0, d, 2).float() / d)
    f = torch.outer(torch.arange(64).float(), inv)
    cs = torch.cat([f.cos(), f.sin()], -1)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    args = (to(x), to(qw), to(z), to(s), None, group, 4)
    want = w4a16_gemv.gemv(*args, config, one_row=True)
    want_cache = to(cache.clone())
    q, kk, v = want.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary(q, kk, to(pos), to(cs), kv_write=(v, want_cache, to(slots)))
    got_cache = to(cache.clone())
    got = w4a16_gemv.rope_gemv1(*args, None, to(pos), to(cs), got_cache, to(slots), hq, hkv,
                                config=config)  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    assert not torch.equal(got_cache.cpu().view(torch.uint8), cache.view(torch.uint8))
