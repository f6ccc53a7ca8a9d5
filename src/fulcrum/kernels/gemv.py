"""Small-batch linear layer ``y = x @ W.T (+ b)`` for the single-stream decode step.

At batch 1 a linear layer reads its whole weight once and does almost no arithmetic: its cost is
the weight bytes over memory bandwidth plus the time the memory system idles around it -- the
kernel's launch and ramp, and the small kernels before it (norm, rotary, attention), during
which no weight is read. The weight is the one input no kernel of the step writes, so this
kernel reads its first tile *before* waiting for the kernel before it (programmatic dependent
launch, ``kernels/pdl.py``): launched early, its programs stream weight while that kernel runs,
then wait for ``x``::

    program p owns output rows [p*BLOCK_N, (p+1)*BLOCK_N) of W  ([N, K], row-major)
        w = W[rows, 0:BLOCK_K]                       ◄── issued before the wait
        wait for the kernel before (it writes x)
        for each K tile t:  w_next = W[rows, tile t+1]    (register double buffer)
                            acc[m, n] += sum_k w[n, k] * x[m, k]     (fp32)
                            w = w_next
        y[m, rows] = acc (* scale[rows]) (+ bias)

fp32 accumulation of bf16/fp16/fp32 products, like cuBLAS's GEMV; results agree with ``F.linear``
to the output dtype's rounding. An FP8 (e4m3) weight with one scale per row
(``quant/fp8.py``) is widened in registers and its scale applied to the sum: half the bytes of
bf16, and the activations stay unquantized (the FP8 GEMM path quantizes them per token). With
one row, the widening is what bounds the kernel (it issues instructions, not loads): the weight
is read as int32 words and widened a pair of values per instruction (``_e4m3_words``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import GEMV_MAX_M, pdl

# Rows of x per call. Up to MAX_M rows the kernel runs; the model uses it up to
# ``KernelConfig.gemv.max_m`` rows (0: never). Measured on an H200 (``benchmarks/gemv_bench.py``)
# at batch 1 it beats cuBLAS on every linear layer of the 8B model, bf16 and FP8 alike.
# Its epilogues (``gemv.fuse_silu``, ``gemv.fuse_rope``) take the next kernel's work into the
# one-row projection: SiLU-and-mul into gate_up, rotary and the K/V cache write into qkv, so
# those launches and their trips through memory drop out of the latency-bound step.
MAX_M = GEMV_MAX_M
# (block_n, block_k, num_warps) on CUDA by weight element size: "bf16" (bf16/fp16, tuned),
# "fp8" (tuned), "fp32" (not tuned: half the bf16 tile, the same register bytes); the
# interpreter's tiles. ``KernelConfig.gemv.launch`` overrides entries of this table.
GPU_CONFIG: dict[str, tuple[int, ...]] = {
    "bf16": (4, 2048, 4),
    # bf16 weights of at most SMALL_N rows and SMALL_K columns (the 8B's qkv and o_proj): one
    # K tile, every load issued before the wait, 87 registers against 156 (5 programs per SM),
    # measured faster on both.
    "bf16_small": (4, 4096, 4),
    "fp8": (4, 1024, 4),
    # one row, read as int32 words (``_e4m3_words``): a K tile of 1,024 columns per 128
    # threads keeps each word's x columns in the thread that holds the word; four rows a
    # program measured fastest of 4, 8 and 16 on the 8B's four linears
    "fp8_words": (4, 1024, 4),
    "fp32": (4, 1024, 4),
}
SMALL_N, SMALL_K = 8192, 4096  # "bf16_small": measured on qkv and o_proj only
INTERPRET_CONFIG = (4, 32, 1)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, max_m: int) -> bool:
    """Whether a linear layer taking it up to ``max_m`` rows should run this kernel for
    ``x [M, K]`` (CUDA callers only)."""
    return x.shape[0] <= min(max_m, MAX_M) and weight.shape[1] == x.shape[1]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    # ROPE only (``rope_gemv``): positions, the [cos | sin] table, slots, the K and V caches
    pos_ptr,
    cs_ptr,
    stride_cs,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    stride_cb,
    stride_co,
    stride_ch,
    K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,  # W is [gate; up] (2N rows): out = silu(gate rows) * up rows
    ROPE: tl.constexpr,  # W is qkv_proj's: rotary on q and k heads, K/V rows into the cache
    HEAD_DIM: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    WORDS: tl.constexpr = False,  # one row of an e4m3 weight, read as int32 words
    FAST: tl.constexpr = False,  # CUDA: the widening in one conversion instruction per pair
):
    pid = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    if SILU:  # rows interleaved gate, up, gate, up, ...: output rows pid * BLOCK_N // 2 + j
        j = tl.arange(0, BLOCK_N)
        offs_o = pid * (BLOCK_N // 2) + j // 2
        mask_n = offs_o < N
        offs_n = offs_o + (j % 2) * N
    elif ROPE:  # rotary pairs (d, d + HALF) of a head interleaved: pair q = pid * BLOCK_N // 2 + j
        j = tl.arange(0, BLOCK_N)
        pair = pid * (BLOCK_N // 2) + j // 2
        mask_n = pair < N // 2
        offs_n = (pair // HALF) * HEAD_DIM + pair % HALF + (j % 2) * HALF
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    # Before the wait: the weight is never written during a step.
    if WORDS:  # e4m3 read as 32-bit words of four weights: see _e4m3_words
        KW: tl.constexpr = BLOCK_K // 4
        offs_w = tl.max_contiguous(tl.arange(0, KW), 2)
        w_ptrs = (
            w_ptr.to(tl.pointer_type(tl.int32))
            + offs_n.to(tl.int64)[:, None] * (stride_wn // 4)
            + offs_w[None, :]
        )
        w = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_w[None, :] < K // 4), other=0)
    else:
        KW: tl.constexpr = BLOCK_K
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        w = tl.load(w_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < K), other=0.0)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    pdl.wait(PDL)
    # One row: products summed elementwise, one reduction at the end. Several rows: a reduction
    # per tile (the branch is resolved at compile time).
    acc1 = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if WORDS:
            nw = (k0 + BLOCK_K) // 4 + offs_w
            w_next = tl.load(
                w_ptrs + (k0 + BLOCK_K) // 4, mask=mask_n[:, None] & (nw[None, :] < K // 4), other=0
            )
        else:
            nk = k0 + BLOCK_K + offs_k
            w_next = tl.load(
                w_ptrs + k0 + BLOCK_K, mask=mask_n[:, None] & (nk[None, :] < K), other=0.0
            )
        if BLOCK_M == 1:
            xf = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            if WORDS:
                acc1 = _e4m3_words(w, xf, acc1, KW, FAST)
            else:
                acc1 += w.to(tl.float32) * xf[None, :]
        else:
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & (k0 + offs_k[None, :] < K), other=0.0)
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        w = w_next
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SILU:  # as silu_and_mul computes it from gate_up's rounded output
        g, u = tl.split(
            tl.reshape(acc.to(out_ptr.dtype.element_ty).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2])
        )
        acc = g / (1.0 + tl.exp(-g)) * u
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask_n = offs_n < N
    if ROPE:
        rope_epilogue(
            acc, pid, N, offs_m, mask_m, out_ptr, stride_om, pos_ptr, cs_ptr, stride_cs,
            slot_ptr, kc_ptr, vc_ptr, stride_cb, stride_co, stride_ch, HEAD_DIM, NUM_Q_HEADS,
            NUM_KV_HEADS, PAGE, KV_FP8, V_TOKEN_MAJOR, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        mask = mask_m[:, None] & mask_n[None, :]
        dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _widen_e4m3x4(w, FAST: tl.constexpr):
    """The four e4m3 values of each int32 of ``w`` (byte 0 first) as fp32. With ``FAST``
    (CUDA, sm_89+) one ``cvt.rn.f16x2.e4m3x2`` per pair and an exact f16 -> f32 move: Triton
    widens byte by byte, with byte shuffles that cost more than the arithmetic."""
    if FAST:
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 l, h;
            .reg .b32 a, b;
            .reg .f16 a0, a1, b0, b1;
            mov.b32 {l, h}, $4;
            cvt.rn.f16x2.e4m3x2 a, l;
            cvt.rn.f16x2.e4m3x2 b, h;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, b0;
            cvt.f32.f16 $3, b1;
            }""",
            "=r,=r,=r,=r,r",
            [w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        f8 = tl.float8e4nv
        w0 = (w & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float32)
        w1 = ((w >> 8) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float32)
        w2 = ((w >> 16) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float32)
        w3 = ((w >> 24) & 0xFF).to(tl.uint8).to(f8, bitcast=True).to(tl.float32)
        return w0, w1, w2, w3


@triton.jit
def _e4m3_words(w, xf, acc, KW: tl.constexpr, FAST: tl.constexpr):
    """``acc[n, j] += sum_i W[n, 4j + i] * x[4j + i]`` for one K tile: ``w`` [BLOCK_N, KW]
    int32 words of four e4m3 weights, ``xf`` [4 * KW] fp32.

    x's four columns of each word come out of one reshape and two splits, which move no data:
    x is loaded eight columns per thread and the words two per thread (``max_contiguous`` in
    the caller), so the thread that holds a word already holds its columns. Per weight: half a
    conversion, one f16 -> f32 move, one FMA."""
    xa, xb = tl.split(tl.reshape(xf, [KW, 2, 2]))
    x0, x2 = tl.split(xa)
    x1, x3 = tl.split(xb)
    w0, w1, w2, w3 = _widen_e4m3x4(w, FAST)
    acc += w0 * x0[None, :]  # one FMA chain per accumulator
    acc += w1 * x1[None, :]
    acc += w2 * x2[None, :]
    acc += w3 * x3[None, :]
    return acc


@triton.jit
def rope_epilogue(
    acc,  # [BLOCK_M, BLOCK_N] fp32 sums: rows (d, d + HALF) of a head, pair after pair
    pid,
    N,
    offs_m,
    mask_m,
    out_ptr,
    stride_om,
    pos_ptr,
    cs_ptr,
    stride_cs,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    stride_cb,
    stride_co,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """What ``kernels/rotary.py`` does after the projection, on this program's pairs: rotate
    q and k heads by each row's position (from the projection rounded to the output dtype, fp32
    math, as that kernel sees it), store q, k, v, and write K/V into the paged cache."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = out_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(acc.to(dt).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
    pair = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    head = pair // HALF
    d = pair % HALF
    mask = mask_m[:, None] & (pair < N // 2)[None, :]
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    cs = cs_ptr + pos[:, None] * stride_cs + d[None, :]
    cos = tl.load(cs, mask=mask, other=1.0)
    sin = tl.load(cs + HALF, mask=mask, other=0.0)
    rot = (head < NUM_Q_HEADS + NUM_KV_HEADS)[None, :]  # q and k heads; v heads pass through
    y1 = tl.where(rot, x1 * cos - x2 * sin, x1).to(dt)
    y2 = tl.where(rot, x2 * cos + x1 * sin, x2).to(dt)
    dst = out_ptr + offs_m[:, None] * stride_om + (head * HEAD_DIM + d)[None, :]
    tl.store(dst, y1, mask=mask)
    tl.store(dst + HALF, y2, mask=mask)
    # K/V heads into the cache, as ``reshape_and_cache.store_kv_row`` writes them
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)[:, None]
    block = slot // PAGE
    off = slot % PAGE
    kv = head - NUM_Q_HEADS  # k heads 0 .. NUM_KV_HEADS-1, then v heads
    is_v = kv >= NUM_KV_HEADS
    h = tl.where(is_v, kv - NUM_KV_HEADS, kv)[None, :]
    y1 = y1.to(tl.float32)
    y2 = y2.to(tl.float32)
    if KV_FP8:  # saturate: out-of-range values would not survive the conversion
        y1 = tl.clamp(y1, -448.0, 448.0)
        y2 = tl.clamp(y2, -448.0, 448.0)
    y1 = y1.to(kc_ptr.dtype.element_ty)
    y2 = y2.to(kc_ptr.dtype.element_ty)
    mask = mask & (slot >= 0)
    k_mask = mask & ((kv >= 0) & ~is_v)[None, :]
    v_mask = mask & is_v[None, :]
    base = block * stride_cb + off * stride_co + h * stride_ch + d[None, :]
    tl.store(kc_ptr + base, y1, mask=k_mask)
    tl.store(kc_ptr + base + HALF, y2, mask=k_mask)
    if V_TOKEN_MAJOR:  # [kv_head, d, page] blocks: token ``off``'s values PAGE apart
        base = block * stride_cb + (h * HEAD_DIM + d[None, :]) * PAGE + off
        tl.store(vc_ptr + base, y1, mask=v_mask)
        tl.store(vc_ptr + base + HALF * PAGE, y2, mask=v_mask)
    else:
        tl.store(vc_ptr + base, y1, mask=v_mask)
        tl.store(vc_ptr + base + HALF, y2, mask=v_mask)


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_M, last dim contiguous
    weight: torch.Tensor,  # [N, K], last dim contiguous
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int] | None = None,  # (block_n, block_k, num_warps); None: tuned
    scale: torch.Tensor | None = None,  # [N] fp32, one per weight row (an FP8 weight's)
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    launch: Mapping[str, tuple[int, int, int]] | None = None,  # GPU_CONFIG entries replaced
    fp8_words: bool = True,  # one row of an e4m3 weight read as int32 words (``GemvConfig``)
) -> torch.Tensor:
    """``(x @ weight.T) * scale + bias`` for a few rows of ``x``, in ``x``'s dtype."""
    return _launch(x, weight, bias, config, scale, pdl_cfg, launch, fp8_words)


def silu_gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2N, K]: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2N]
    config: tuple[int, int, int] | None = None,
    scale: torch.Tensor | None = None,  # [2N]
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    launch: Mapping[str, tuple[int, int, int]] | None = None,
    fp8_words: bool = True,
) -> torch.Tensor:
    """``silu_and_mul(gemv(x, weight, ...))`` -- ``[M, N]`` -- in one kernel: each program
    owns matching gate and up rows and applies the activation to its sums (rounded to x's
    dtype first, as the separate activation kernel sees them). No extra memory traffic."""
    if weight.shape[0] % 2:
        raise ValueError(f"silu_gemv: gate and up rows, got {weight.shape[0]} rows")
    return _launch(x, weight, bias, config, scale, pdl_cfg, launch, fp8_words, "silu")


def rope_gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, K]: q, k, v rows
    positions: torch.Tensor,  # [M] int
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: [cos | sin]
    kv_cache: torch.Tensor,  # [2, num_blocks, page, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [>= M] int; -1: a padding row, not written
    num_heads: int,
    num_kv_heads: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    scale: torch.Tensor | None = None,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    launch: Mapping[str, tuple[int, int, int]] | None = None,
    fp8_words: bool = True,
) -> torch.Tensor:
    """The qkv projection, rotary on its q and k heads and its K/V rows written into the
    paged cache, in one kernel: ``gemv`` then ``kernels/rotary.apply_rotary(..., kv_write=...)``
    (same rounding). Each program owns rotary pairs -- rows d and d + head_dim/2 of a head --
    so the rotation needs nothing another program computes. Rotary over the whole head only
    (a partial ``rotary_dim`` takes the separate kernel)."""
    from fulcrum.kv_cache.dtype import is_fp8, v_token_major

    head_dim = cos_sin_cache.shape[1]
    n = weight.shape[0]
    if n != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"rope_gemv: {n} weight rows for {num_heads} + 2 x {num_kv_heads} heads of "
            f"{head_dim} (the rotary dim must be the head dim)"
        )
    assert cos_sin_cache.stride(-1) == 1 and slot_mapping.shape[0] >= x.shape[0]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
    rope = (
        (positions, cos_sin_cache, cos_sin_cache.stride(0), slot_mapping, k_cache, v_cache)
        + k_cache.stride()[:3],
        dict(
            HEAD_DIM=head_dim,
            NUM_Q_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            PAGE=k_cache.shape[1],
            KV_FP8=is_fp8(kv_cache.dtype),
            V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
        ),
    )
    return _launch(x, weight, bias, config, scale, pdl_cfg, launch, fp8_words, "rope", rope)


def reads_words(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row against this weight can take the int32-word path (``_e4m3_words``):
    an e4m3 weight whose rows are whole 32-bit words."""
    return (
        x.shape[0] == 1
        and weight.dtype == torch.float8_e4m3fn
        and weight.shape[1] % 4 == 0
        and weight.stride(0) % 4 == 0
        and weight.data_ptr() % 4 == 0
    )


def _launch(x, weight, bias, config, scale, pdl_cfg, launch, fp8_words, epilogue=None, rope=None):
    silu = epilogue == "silu"
    m, k = x.shape
    n, k_w = weight.shape
    if m > MAX_M or k != k_w:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    n //= 2 if silu else 1  # output columns
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    words = fp8_words and reads_words(x, weight)
    if config is None:
        kind = {1: "fp8_words" if words else "fp8", 2: "bf16"}.get(weight.element_size(), "fp32")
        if kind == "bf16" and weight.shape[0] <= SMALL_N and k <= SMALL_K:
            kind = "bf16_small"
        if not x.is_cuda:
            config = INTERPRET_CONFIG
        else:  # an empty override table costs one truth test
            config = (launch.get(kind) if launch else None) or GPU_CONFIG[kind]
    block_n, block_k, warps = config
    assert block_n >= 2 or epilogue is None
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = (triton.cdiv(n, block_n // 2 if silu else block_n),)
    mode = pdl.mode(x, grid[0], pdl_cfg, early=True)  # released before its wait: measured faster
    if scale is not None:
        assert scale.dtype == torch.float32 and scale.is_contiguous()
        assert scale.numel() == weight.shape[0]
    rope_args, rope_consts = rope or ((weight,) * 6 + (0, 0, 0), _NO_ROPE)
    _gemv_kernel[grid](
        x,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *rope_args,
        K=k,
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        SILU=silu,
        ROPE=epilogue == "rope",
        **rope_consts,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=mode,
        WORDS=words,
        FAST=words and x.is_cuda,
        num_warps=warps,
        **pdl.launch_options(mode),
    )
    return out


_NO_ROPE = dict(
    HEAD_DIM=2, NUM_Q_HEADS=1, NUM_KV_HEADS=1, PAGE=1, KV_FP8=False, V_TOKEN_MAJOR=False
)
