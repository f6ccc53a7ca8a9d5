"""Torch versions of mixture-of-experts routing and experts: the CPU path of the model and the
reference the Triton kernels (``kernels/moe_routing.py``, ``kernels/fused_moe.py``) are tested
against. Free of triton, which the CPU does not need."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch version of :func:`topk_softmax` (transformers' Mixtral/Qwen-MoE routers)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Plain torch version: ``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` with
    only the set entries (a stable sort by expert)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    total = int(padded.sum())
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[expert] + rank] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    ).to(torch.int32)
    return sorted_ids, expert_ids, total


def expert_weights(w13, w2, w13_scale, w2_scale, e: int, dtype: torch.dtype):
    """Expert ``e``'s ``(w13, w2)`` in ``dtype`` (FP8 rows widened and scaled)."""
    if w13_scale is None:
        return w13[e], w2[e]
    a = (w13[e].float() * w13_scale[e, :, None]).to(dtype)
    return a, (w2[e].float() * w2_scale[e, :, None]).to(dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-expert loop (transformers' order of operations): each expert that any token
    picked runs on its rows; FP8 experts are widened and scaled first."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in topk_ids.unique().tolist():
        tok, slot = torch.where(topk_ids == e)
        a, b = expert_weights(w13, w2, w13_scale, w2_scale, e, x.dtype)
        gate, up = F.linear(x[tok], a).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, b) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out
