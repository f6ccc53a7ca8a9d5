"""LoRA for a batch whose rows use different adapters, at fixed shapes (CUDA graphs): each row
reads its own adapter's weights by the slot index beside it.

    v[t]  = A[slot[t]] @ x[t]          shrink: A [S, R, in] -> partial sums p [SPLIT, T, R] (f32)
    y[t] += B[slot[t]] @ v[t]          expand: v[t] = sum of p[:, t], B [S, out, R] (scaling
                                       folded in), y [T, out]

Slot 0 is the base model: its weights are zeros, and its rows return at once, so a padded row
of a graph bucket (slot 0) and a base-model row cost a slot load. A decode batch is a few rows
and the rank is small, so the shrink splits the input dimension across programs (one program
per row would stream a whole ``[R, in]`` matrix through one SM); each program writes its own
partial sums and the expand adds them in split order as it reads ``v`` -- no atomics, no
zeroed buffer, the same result run to run. An adapter's A and B stay in L2 across the rows that
share it, and no row order or grouping is needed, so the shapes a graph captured hold for any
mix of adapters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs the shrink aims for: enough to keep every SM of a large GPU streaming its share.
_SHRINK_PROGRAMS = 256


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, p_ptr, K, R, K_SPLIT, stride_x, stride_as, stride_ar, stride_ps,
    stride_pt, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], tl.float32)
    if slot != 0:
        a_row = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
        k_end = tl.minimum(K, (split + 1) * K_SPLIT)
        for k0 in range(split * K_SPLIT, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_x + k, mask=k < k_end, other=0.0).to(tl.float32)
            a = tl.load(a_row + k[None, :], mask=(r[:, None] < R) & (k[None, :] < k_end), other=0.0)
            acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(p_ptr + split * stride_ps + t * stride_pt + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slot_ptr, p_ptr, N, R, SPLIT, stride_y, stride_bs, stride_bn, stride_ps,
    stride_pt, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot == 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    v = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, SPLIT):
        v += tl.load(p_ptr + s * stride_ps + t * stride_pt + r, mask=r < R, other=0.0)
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
        mask=(n[:, None] < N) & (r[None, :] < R),
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * v[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + n, mask=n < N, other=0.0)
    tl.store(y_ptr + t * stride_y + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n < N)


def _shrink_launch(t: int, k: int, r: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_K, split)``: the input dimension is cut into ``split`` whole tiles,
    as many as fill ``_SHRINK_PROGRAMS`` programs over the rows and rank blocks."""
    block_r = min(triton.next_power_of_2(r), 64)
    block_k = max(16, min(128, 4096 // block_r))
    tiles = triton.cdiv(k, block_k)
    split = max(1, min(tiles, _SHRINK_PROGRAMS // (t * triton.cdiv(r, block_r))))
    return block_r, block_k, split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Partial sums ``p [SPLIT, T, R]`` (float32) of row ``t`` of ``x [T, in]`` times
    ``a[slots[t]]`` ([R, in]) over ``SPLIT`` slices of the input; ``lora_expand`` adds them."""
    t, k = x.shape
    r = a.shape[1]
    if t == 0:
        return torch.empty(1, 0, r, dtype=torch.float32, device=x.device)
    assert x.stride(1) == 1 and a.stride(2) == 1
    block_r, block_k, split = _shrink_launch(t, k, r)
    tiles_per_split = triton.cdiv(triton.cdiv(k, block_k), split)
    split = triton.cdiv(triton.cdiv(k, block_k), tiles_per_split)  # no empty slice
    p = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    grid = (t, triton.cdiv(r, block_r), split)
    _shrink_kernel[grid](x, a, slots, p, k, r, tiles_per_split * block_k, x.stride(0),
                         a.stride(0), a.stride(1), p.stride(0), p.stride(1),
                         BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)  # fmt: skip
    return p


def lora_expand(y: torch.Tensor, p: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """``y[t] += b[slots[t]] @ v[t]`` in place, for ``y [T, out]``, ``b [S, out, R]`` and ``v``
    the sum over the first dimension of the shrink's partials ``p [SPLIT, T, R]``."""
    t, n = y.shape
    r = b.shape[2]
    if t == 0:
        return
    assert y.stride(1) == 1 and b.stride(2) == 1
    block_r = triton.next_power_of_2(r)
    block_n = max(16, min(128, 8192 // block_r))
    grid = (t, triton.cdiv(n, block_n))
    _expand_kernel[grid](y, b, slots, p, n, r, p.shape[0], y.stride(0), b.stride(0), b.stride(1),
                         p.stride(0), p.stride(1), BLOCK_N=block_n, BLOCK_R=block_r,
                         num_warps=4)  # fmt: skip


def lora_rows_torch(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """The reference (and the CPU's path): ``y[t] += b[slots[t]] @ (a[slots[t]] @ x[t])``."""
    s = slots.long()
    v = torch.einsum("tri,ti->tr", a[s].float(), x.float())
    y += torch.einsum("tnr,tr->tn", b[s].float(), v).to(y.dtype)
