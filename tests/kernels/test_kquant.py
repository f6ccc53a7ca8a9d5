"""GGUF K-quants (``kernels/kquant.py``, ``quant/gguf_kquant.py``): blocks of random bytes
repacked and dequantized equal ``gguf``'s own dequantizer, and the GEMV and GEMM equal
dequantize-then-matmul (in the interpreter on the CPU, compiled on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fulcrum.kernels import kquant
from fulcrum.quant.gguf_kquant import BYTES, repack_k_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """``uint8 [n, bytes per row]``: every byte random but the fp16 scales (finite, small)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256 * BYTES[type_name]), dtype=np.uint8)
    blocks = raw.reshape(-1, BYTES[type_name])
    for off in [208] if type_name == "Q6_K" else [0, 2]:
        f = rng.uniform(-0.01, 0.01, len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = f.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("type_name", list(BYTES))
def test_repacked_blocks_equal_gguf_dequantizer(type_name: str) -> None:
    import gguf

    n, k = 12, 768
    raw = random_blocks(type_name, n, k, seed=len(type_name) + n)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    w = repack_k_blocks(raw, type_name, n, k)
    assert torch.equal(kquant.dequantize(w).t(), torch.from_numpy(want))
    hi = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}[type_name]
    assert w.qlo.shape == (k // 8, n) and (w.qhi is None) == (hi == 0)
    assert hi == 0 or w.qhi.shape == (k * hi // 32, n)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="type Q3_K with 256 inputs; K-quants are Q4_K"):
        repack_k_blocks(np.zeros((2, 110), np.uint8), "Q3_K", 2, 256)
    w = repack_k_blocks(random_blocks("Q4_K", 16, 256, 0), "Q4_K", 16, 256)
    with pytest.raises(ValueError, match="do not fit"):
        kquant.gemv(torch.zeros(1, 512), w, None)


def _case(type_name: str, m: int, k: int, n: int, bias: bool, seed: int):
    w = repack_k_blocks(random_blocks(type_name, n, k, seed), type_name, n, k)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = kquant.reference_matmul(x, w, b)
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x), kquant.KPacked(w.qtype, *(to(t) for t in w[1:])), to(b), want


GEMV_CASES = [("Q4_K", 1, 512, 40, False), ("Q5_K", 3, 256, 24, True), ("Q6_K", 1, 256, 16, True),
              ("Q6_K", 2, 512, 20, False), ("Q4_K", 4, 256, 32, True)]  # fmt: skip


@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv_equals_reference(case) -> None:
    x, w, b, want = _case(*case, seed=sum(case[1:4]))
    torch.testing.assert_close(kquant.gemv(x, w, b).cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_gemv_equals_reference(split: int) -> None:
    """K over ``split`` programs per strip, partial sums (and the bias once) added atomically."""
    x, w, b, want = _case("Q5_K", 2, 512, 24, True, seed=split)
    cfg = (16, 64, 1, split) if DEVICE == "cpu" else (32, 128, 4, split)
    torch.testing.assert_close(kquant.gemv(x, w, b, cfg).cpu(), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not divide K"):
        kquant.gemv(x, w, b, (16, 256, 1, 4))


@pytest.mark.parametrize("case", [("Q4_K", 5, 256, 40, True), ("Q5_K", 17, 512, 16, False),
                                  ("Q6_K", 9, 256, 24, True)])  # fmt: skip
def test_gemm_equals_reference(case) -> None:
    x, w, b, want = _case(*case, seed=sum(case[1:4]))
    torch.testing.assert_close(kquant.gemm(x, w, b).cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 20])  # the GEMV up to gemv.max_m rows, the GEMM above
@pytest.mark.parametrize("kinds", [["Q8_0", "Q6_K", "Q6_K", "Q4_K"], ["Q5_K"]])
def test_gguf_layer_runs_each_part_through_its_kernels(monkeypatch, rows: int, kinds) -> None:
    """A fused GGUF layer whose shards mix types (adjacent shards of one type merge into one
    part) through its Triton path, forced on the CPU: equal to its dequantized weight."""
    import gguf

    import fulcrum.quant.gguf as gguf_quant
    from fulcrum.kernels import w4a16

    k, size = 256, 16
    lin = gguf_quant.GgufLinear(k, size * len(kinds), bias=True)
    lin.check_format("layer")
    gen = torch.Generator().manual_seed(rows)
    for i, t in enumerate(kinds):
        if t in BYTES:
            raw = random_blocks(t, size, k, seed=i)
        else:
            w = torch.randn(size, k, generator=gen).numpy() * 0.05
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[t])
        assert lin.load_packed("blocks", gguf_quant.GgufBlocks(t, raw, size, k), (i * size, size))
    lin.bias.data.normal_(generator=gen)
    lin.finish_loading()
    merged = [t for i, t in enumerate(kinds) if i == 0 or kinds[i - 1] != t]
    assert [p.type_name for p in lin.parts] == merged
    x = torch.randn(rows, k, generator=gen)
    want = x @ lin.dequantized_weight().t() + lin.bias
    called = []
    for mod in (kquant, w4a16):
        for name in ("gemv", "gemm"):
            real = getattr(mod, name)
            spy = lambda *a, _r=real, _n=name, **kw: called.append(_n) or _r(*a, **kw)  # noqa: E731
            monkeypatch.setattr(mod, name, spy)
    monkeypatch.setattr(gguf_quant, "use_triton", lambda x, kc: True)
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    few = rows <= min(lin.kernel_config.gemv.max_m, 4)
    assert called == ["gemv" if few else "gemm"] * len(merged)
