"""Small-batch linear layers (``y = x @ W.T``, a few rows of ``x``) with the op before them fused.

At decode batch sizes of a few requests a linear layer is a matrix-vector product: it reads the
whole weight once and does almost no arithmetic, so its cost is the weight bytes over memory
bandwidth plus a fixed launch and ramp cost. The small element-wise kernel that usually runs
before it (RMSNorm with the residual add, SiLU-and-multiply) costs about as much as its own
launch; here it runs inside the weight-streaming loop instead::

    program p owns output columns [p*BLOCK_N, (p+1)*BLOCK_N) for all M rows
    for each K tile:   x_t = prologue(x[:, k0:k0+BLOCK_K])          (tiny, from L2)
                       acc += x_t @ W[cols, k0:k0+BLOCK_K].T        (the weight stream)
    NORM prologues:    acc *= rsqrt(sum_k h_k^2 / K + eps)          (per row, after the loop)

Prologues (``x`` is ``[M, K]``, or ``[M, 2K]`` for SILU):

    NONE       x
    NORM       rmsnorm(x) * norm_weight                  (the per-row scale applied after the loop)
    ADD_NORM   h = x + residual (rounded to x's dtype, written once to ``new_residual``),
               then NORM of h
    SILU       silu(x[:, :K]) * x[:, K:]                  (fp32 math, rounded once)

RMSNorm's scale ``rsqrt(mean(h^2) + eps)`` is a per-row scalar, so it is taken out of the dot
product and applied to the accumulator: ``h * w_norm`` feeds the tensor cores and the row's sum of
squares accumulates alongside. This rounds differently from normalising first (the reference
rounds ``h * rstd`` to bf16 before the weight multiply): results agree to bf16 precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, NORM, ADD_NORM, SILU = 0, 1, 2, 3
MAX_M = 16  # rows per call: one 16-row tensor-core tile
# (block_n, block_k, num_warps, num_stages) by weight shape class on CUDA, tuned on an H200 with
# benchmarks/gemv_bench.py; the interpreter uses small tiles.
GPU_CONFIG: dict[str, tuple[int, int, int, int]] = {
    "default": (32, 256, 4, 4),
}
INTERPRET_CONFIG = (16, 32, 4, 1)


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    new_res_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_rm,
    stride_nrm,
    stride_wn,
    stride_om,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xm = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
        if PROLOGUE == 2:  # ADD_NORM
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=xm, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            if pid == 0:
                tl.store(new_res_ptr + offs_m[:, None] * stride_nrm + offs_k[None, :], x, mask=xm)
        if PROLOGUE == 1 or PROLOGUE == 2:  # NORM, ADD_NORM
            h = x.to(tl.float32)
            ss += tl.sum(h * h, 1)
            nw = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = h * nw[None, :]
        if PROLOGUE == 3:  # SILU: x holds the gate half, the up half is K columns further
            up = tl.load(x_rows + K + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * up).to(x.dtype)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PRECISION)
    if PROLOGUE == 1 or PROLOGUE == 2:
        acc *= tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(n: int, k: int, cuda: bool) -> tuple[int, int, int, int]:
    if not cuda:
        return INTERPRET_CONFIG
    return GPU_CONFIG.get(f"{n}x{k}", GPU_CONFIG["default"])


def gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] for SILU), M <= MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    prologue: int = NONE,
    residual: torch.Tensor | None = None,  # [M, K] for ADD_NORM
    norm_weight: torch.Tensor | None = None,  # [K] for NORM / ADD_NORM
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``prologue(x) @ weight.T + bias`` as ``[M, N]`` in ``x``'s dtype; returns it with the
    new residual (``x + residual``) for ADD_NORM, else None."""
    m = x.shape[0]
    n, k = weight.shape
    assert 1 <= m <= MAX_M, f"gemv takes 1..{MAX_M} rows, got {m}"
    assert weight.is_contiguous() and x.stride(-1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU else k)
    assert (norm_weight is not None) == (prologue in (NORM, ADD_NORM))
    assert (residual is not None) == (prologue == ADD_NORM)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        new_res = torch.empty_like(x)
    block_n, block_k, warps, stages = _config(n, k, x.is_cuda)
    grid = (triton.cdiv(n, block_n),)
    _gemv_kernel[grid](
        x,
        residual if residual is not None else x,
        new_res if new_res is not None else x,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        new_res.stride(0) if new_res is not None else 0,
        weight.stride(0),
        out.stride(0),
        eps,
        K=k,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    return out, new_res


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = NONE,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain torch version of :func:`gemv`: the unfused ops, in fp32, rounded where the model
    rounds (the residual sum, the SiLU product)."""
    new_res = None
    h = x.float()
    if prologue == ADD_NORM:
        new_res = (x.float() + residual.float()).to(x.dtype)
        h = new_res.float()
    if prologue in (NORM, ADD_NORM):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    if prologue == SILU:
        gate, up = h.chunk(2, dim=-1)
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
    y = h @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), new_res
