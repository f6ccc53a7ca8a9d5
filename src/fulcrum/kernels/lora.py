"""LoRA for a batch whose rows use different adapters, at fixed shapes (CUDA graphs): each row
reads its own adapter's weights by the slot index beside it.

    v[t]  = A[slot[t]] @ x[t]          shrink: A [S, R, in] -> v [T, R] (float32)
    y[t] += B[slot[t]] @ v[t]          expand: B [S, out, R] (scaling folded in), y [T, out]

Slot 0 is the base model: its weights are zeros, and its rows return at once, so a padded row
of a graph bucket (slot 0) and a base-model row cost a slot load. One program per row (and
block of the rank or of the output): a decode batch is small, an adapter's A and B stay in L2
across the rows that share it, and no row order or grouping is needed, so the shapes a graph
captured hold for any mix of adapters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, v_ptr, K, R, stride_x, stride_as, stride_ar, stride_v,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if slot == 0:
        tl.store(v_ptr + t * stride_v + r, tl.zeros([BLOCK_R], tl.float32), mask=r < R)
        return
    acc = tl.zeros([BLOCK_R], tl.float32)
    a_row = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_row + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
    tl.store(v_ptr + t * stride_v + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slot_ptr, v_ptr, N, R, stride_y, stride_bs, stride_bn, stride_v,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot == 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    v = tl.load(v_ptr + t * stride_v + r, mask=r < R, other=0.0)
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
        mask=(n[:, None] < N) & (r[None, :] < R),
        other=0.0,
    )
    delta = tl.sum(b.to(tl.float32) * v[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + n, mask=n < N, other=0.0)
    tl.store(y_ptr + t * stride_y + n, (y.to(tl.float32) + delta).to(y.dtype), mask=n < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``v [T, R]`` (float32): row ``t`` of ``x [T, in]`` times ``a[slots[t]]`` ([R, in])."""
    t, k = x.shape
    r = a.shape[1]
    v = torch.empty(t, r, dtype=torch.float32, device=x.device)
    if t == 0:
        return v
    assert x.stride(1) == 1 and a.stride(2) == 1
    block_r = min(triton.next_power_of_2(r), 64)
    grid = (t, triton.cdiv(r, block_r))
    _shrink_kernel[grid](x, a, slots, v, k, r, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
                         BLOCK_R=block_r, BLOCK_K=128, num_warps=4)  # fmt: skip
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """``y[t] += b[slots[t]] @ v[t]`` in place, for ``y [T, out]`` and ``b [S, out, R]``."""
    t, n = y.shape
    r = b.shape[2]
    if t == 0:
        return
    assert y.stride(1) == 1 and b.stride(2) == 1
    block_r = triton.next_power_of_2(r)
    block_n = max(16, min(128, 8192 // block_r))
    grid = (t, triton.cdiv(n, block_n))
    _expand_kernel[grid](y, b, slots, v, n, r, y.stride(0), b.stride(0), b.stride(1), v.stride(0),
                         BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)  # fmt: skip


def lora_rows_torch(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """The reference (and the CPU's path): ``y[t] += b[slots[t]] @ (a[slots[t]] @ x[t])``."""
    s = slots.long()
    v = torch.einsum("tri,ti->tr", a[s].float(), x.float())
    y += torch.einsum("tnr,tr->tn", b[s].float(), v).to(y.dtype)
