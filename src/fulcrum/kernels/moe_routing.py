"""Mixture-of-experts routing: each token's top-k experts, then the tokens grouped by expert.

``topk_softmax``: router logits ``[T, E]`` -> the softmax over all experts (fp32), its k largest
(renormalised over the k where the model says so: Mixtral always, Qwen-MoE by
``norm_topk_prob``) and their expert ids. One program per token.

``moe_align_block_size``: the ``T * k`` (token, slot) pairs sorted by expert, each expert's run
padded to a multiple of ``BLOCK_M`` rows, so that every ``BLOCK_M``-row tile of the grouped GEMM
(``kernels/fused_moe.py``) belongs to one expert::

    flat ids (token-major)   t0:[2, 0]  t1:[2, 1]  t2:[0, 2]        (k = 2, E = 4, BLOCK_M = 2)
    sorted_token_ids         [1, 4 | 3, P | 0, 2, 5, P]              P = T * k (a padding row)
    expert_ids (per tile)    [0,     1,     2,    2]
    num_tokens_post_padded   8

An entry of ``sorted_token_ids`` is a flat index ``t * k + slot``; within an expert they keep
token order. An expert no token picked gets no tile. Sizes depend only on ``T * k``, ``E`` and
``BLOCK_M`` (:func:`align_capacity`), never on the routing, so a CUDA graph can capture it: the
GEMM's grid covers the capacity and tiles past ``num_tokens_post_padded`` return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    E,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)
    ko = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], tl.float32)
    idxs = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        v = tl.max(p, 0)
        i = tl.argmax(p, 0)  # the lowest index among equals
        vals = tl.where(ko == j, v, vals)
        idxs = tl.where(ko == j, i, idxs)
        p = tl.where(offs == i, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, 0)
    tl.store(weights_ptr + row * TOP_K + ko, vals, mask=ko < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ko, idxs, mask=ko < TOP_K)


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights [T, k] float32, ids [T, k] int32)``, largest first."""
    t, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t:
        _topk_softmax_kernel[(t,)](
            logits, weights, ids, logits.stride(0), e, TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k),
            RENORM=renormalize, num_warps=1 if e <= 128 else 4,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    N,
    E,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # a power of two > E: bin BLOCK_E - 1 takes the masked lanes
    CHUNK: tl.constexpr,
):
    # One program per expert: each counts every expert's pairs (to find where its own run
    # starts), then writes its run, its padding and its tiles' expert id.
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    hist = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, N, CHUNK):
        ids = tl.load(ids_ptr + c0 + offs, mask=c0 + offs < N, other=BLOCK_E - 1)
        hist += tl.histogram(ids, BLOCK_E)
    eo = tl.arange(0, BLOCK_E)
    padded = tl.where(eo < E, (hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(eo < e, padded, 0), 0)
    count = tl.sum(tl.where(eo == e, hist, 0), 0)
    n_pad = tl.sum(tl.where(eo == e, padded, 0), 0)
    if e == 0:
        tl.store(num_post_pad_ptr, tl.sum(padded, 0))
    if count > 0:
        run = tl.full((), 0, tl.int32)
        for c0 in range(0, N, CHUNK):
            m = c0 + offs < N
            hit = (tl.load(ids_ptr + c0 + offs, mask=m, other=-1) == e).to(tl.int32)
            pos = start + run + tl.cumsum(hit, 0) - 1
            tl.store(sorted_ptr + pos, c0 + offs, mask=(hit != 0) & m)
            run += tl.sum(hit, 0)
        tail = start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + tail, N, mask=tail < start + n_pad)
        first, n_tiles = start // BLOCK_M, n_pad // BLOCK_M
        for b0 in range(0, n_tiles, CHUNK):
            tl.store(expert_ids_ptr + first + b0 + offs, e, mask=b0 + offs < n_tiles)


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of ``sorted_token_ids`` that hold any routing of ``num_pairs`` (token, slot) pairs:
    each expert that gets a pair pads its run by fewer than ``block_m`` rows."""
    cap = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(cap, block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(sorted_token_ids [cap] int32, expert_ids [cap / block_m]
    int32, num_tokens_post_padded [1] int32)``; entries past ``num_tokens_post_padded`` are
    unset."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    n = ids.numel()
    cap = align_capacity(n, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_post_pad = torch.zeros(1, dtype=torch.int32, device=dev)
    if n:
        chunk = min(1024, max(16, triton.next_power_of_2(n)))
        _align_kernel[(num_experts,)](
            ids, sorted_ids, expert_ids, num_post_pad, n, num_experts, BLOCK_M=block_m,
            BLOCK_E=triton.next_power_of_2(num_experts + 1), CHUNK=chunk, num_warps=4,
        )  # fmt: skip
    return sorted_ids, expert_ids, num_post_pad
