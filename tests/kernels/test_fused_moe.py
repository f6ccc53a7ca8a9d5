"""The fused MoE kernels (routing, align, grouped GEMMs) against plain torch on random inputs,
through Triton's interpreter on the CPU (small shapes), experts without tokens included."""

from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.fused_moe import fused_moe
from fulcrum.kernels.moe_routing import align_capacity, moe_align_block_size, topk_softmax
from fulcrum.kernels.quant_fp8 import per_token_quant_fp8_ref
from fulcrum.model.layers.moe_ref import fused_moe_ref, moe_align_block_size_ref, topk_softmax_ref


@pytest.mark.parametrize(("t", "e", "k", "renorm"), [(1, 8, 2, True), (7, 6, 2, False),
                                                     (5, 60, 4, False), (3, 128, 8, True)])  # fmt: skip
def test_topk_softmax_matches_torch(t, e, k, renorm) -> None:
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t + e))
    w, ids = topk_softmax(logits, k, renorm)
    w_ref, ids_ref = topk_softmax_ref(logits, k, renorm)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(t))


@pytest.mark.parametrize(("t", "e", "k", "block_m"), [(1, 8, 2, 16), (9, 6, 2, 4),
                                                      (40, 16, 4, 16), (300, 5, 1, 16)])  # fmt: skip
def test_align_matches_torch_and_skips_unused_experts(t, e, k, block_m) -> None:
    g = torch.Generator().manual_seed(t)
    # Route among the even experts only: the odd ones get no token and must get no tile.
    evens = torch.arange(0, e, 2)
    ids = torch.stack([evens[torch.randperm(len(evens), generator=g)[:k]] for _ in range(t)])
    ids = ids.to(torch.int32)
    sorted_ids, expert_ids, num_pad = moe_align_block_size(ids, e, block_m)
    ref_sorted, ref_experts, ref_total = moe_align_block_size_ref(ids, e, block_m)
    assert int(num_pad) == ref_total and ref_total % block_m == 0
    assert sorted_ids.numel() == align_capacity(t * k, e, block_m) >= ref_total
    assert torch.equal(sorted_ids[:ref_total], ref_sorted)
    assert torch.equal(expert_ids[: ref_total // block_m], ref_experts)
    used = set(ids.flatten().tolist())
    assert set(ref_experts.tolist()) == used and not any(x % 2 for x in used)


def _inputs(t, h, inter, e, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    logits[:, e // 2 :] -= 100.0  # the upper half of the experts gets no token
    weights, ids = topk_softmax_ref(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("t", "h", "inter", "e", "k", "launch"),
    [
        (1, 64, 32, 8, 2, None),
        (5, 48, 40, 6, 2, None),  # H, I not multiples of the tiles
        (33, 32, 64, 8, 3, (16, 32, 16, 1, 1)),  # several tiles per expert and along K
        (12, 32, 16, 4, 1, (32, 16, 32, 1, 1)),  # k = 1: no combine
    ],
)
def test_fused_moe_matches_per_expert_loop(t, h, inter, e, k, launch) -> None:
    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, torch.float32, seed=t)
    assert int(ids.max()) < e // 2 or k > e // 2  # some experts are left without tokens
    out = fused_moe(x, w13, w2, weights, ids, launch=launch)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.abs().max() > 0.05
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The experts in e4m3 with one scale per row: ``q13, q2, s13, s2``."""
    e, two_i, h = w13.shape
    q13, s13 = per_token_quant_fp8_ref(w13.reshape(-1, h))
    q2, s2 = per_token_quant_fp8_ref(w2.reshape(-1, two_i // 2))
    return (q13.view(e, two_i, h), q2.view(e, h, two_i // 2), s13.view(e, two_i),
            s2.view(e, h))  # fmt: skip


def test_fused_moe_fp8_experts_match_the_dequantized_loop() -> None:
    t, h, inter, e, k = 6, 64, 32, 4, 2
    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, torch.float32, seed=7)
    q13, q2, s13, s2 = _fp8_experts(w13, w2)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2)
    ref = fused_moe_ref(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # and close to the full-precision experts (e4m3 keeps ~2 significant digits)
    full = fused_moe_ref(x, w13, w2, weights, ids)
    assert (out - full).abs().max() < 0.1 * full.abs().max()


def _w8a8_ref(x, q13, q2, weights, ids, s13, s2) -> torch.Tensor:
    """The per-expert loop with the activations quantized per row as the kernel does: x before
    gate_up, the gated product (rounded to x's dtype) before down."""
    out = torch.zeros_like(x)
    qx, sx = per_token_quant_fp8_ref(x)
    xd = qx.float() * sx
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        a = q13[e].float() * s13[e, :, None]
        b = q2[e].float() * s2[e, :, None]
        gate, up = (xd[tok] @ a.T).chunk(2, dim=-1)
        hq, hs = per_token_quant_fp8_ref((torch.nn.functional.silu(gate) * up).to(x.dtype))
        y = (hq.float() * hs) @ b.T * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def test_fused_moe_fp8_activations_match_the_w8a8_loop() -> None:
    """From ``act_fp8_rows`` rows per expert both operands are e4m3: the kernel equals the loop
    that quantizes the same rows, and stays close to the weight-only result."""
    t, h, inter, e, k = 12, 64, 48, 4, 2
    x, w13, w2, weights, ids = _inputs(t, h, inter, e, k, torch.float32, seed=11)
    q13, q2, s13, s2 = _fp8_experts(w13, w2)
    launch = (16, 32, 32, 1, 1)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2, launch=launch, act_fp8_rows=t * k // e)
    torch.testing.assert_close(out, _w8a8_ref(x, q13, q2, weights, ids, s13, s2),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    w8a16 = fused_moe(x, q13, q2, weights, ids, s13, s2, launch=launch)
    assert not torch.equal(out, w8a16)  # the switch took the other path
    assert (out - w8a16).abs().max() < 0.1 * w8a16.abs().max()
    below = fused_moe(x, q13, q2, weights, ids, s13, s2, launch=launch, act_fp8_rows=t * k)
    assert torch.equal(below, w8a16)  # fewer rows per expert than the threshold: weight-only


def test_fused_moe_rejects_mismatched_shapes() -> None:
    x, w13, w2, weights, ids = _inputs(2, 32, 16, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights[:1], ids[:1])
    with pytest.raises(ValueError, match="scales"):
        fused_moe(x, w13, w2, weights, ids, torch.ones(4, 3), torch.ones(4, 32))
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)
