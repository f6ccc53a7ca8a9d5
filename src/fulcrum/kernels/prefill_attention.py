"""Paged prefill / extend attention over a flattened varlen batch.

Request ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]`` (its new chunk) and a
context of ``seq_lens[b]`` tokens, all already in the paged cache (the new K/V were written by
``reshape_and_cache`` first). New token ``i`` sits at position ``prefix + i`` and sees keys
``0..prefix + i``.

One program per (work item, kv head); a work item is one (request, query block) of a request
with new tokens, listed on the host (:func:`prefill_work`), heaviest first, so a mixed step with
hundreds of decode rows launches no programs for them. A program packs ``BLOCK_Q`` query tokens times
the ``GROUP`` query heads of its kv head into the ``BLOCK_M`` rows of one tile, so each K/V tile
it loads serves every head of the group::

    row r of the tile  ->  token  q0 + r // GROUP   (q0 = query block * BLOCK_Q)
                           head   kvh * GROUP + r % GROUP
    rows r >= BLOCK_Q * GROUP, or whose token is past the chunk, are padding (masked)

    keys:  [ 0 ................. prefix + q0 | .. prefix + q0 + BLOCK_Q )   (hi, exclusive)
             all rows see these               causal mask: key n <= prefix + token

The grid is ``(num_work_items, num_kv_heads)``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl

from fulcrum.config import PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.kv_dtype import (
    compute_dtype,
    dot_precision,
    load_v_token_major,
    tile_tokens,
)
from fulcrum.kv_cache.dtype import is_fp8, v_rows, v_token_major

# Launch parameters (BLOCK_M rows hold BLOCK_M // GROUP query tokens times GROUP heads). The
# large config was tuned on an H200 with benchmarks/kernels_bench.py and needs ~200 KB of shared
# memory for 16-bit K/V at head_dim 128; fp32 caches and GPUs with less shared memory get the
# small one; the interpreter gets small tiles.
GPU_CONFIG: dict[str, int] = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
GPU_SMALL_SMEM_CONFIG: dict[str, int] = {
    "block_m": 128,
    "block_n": 64,
    "num_warps": 4,
    "num_stages": 2,
}
# An FP8 cache: its V tile is token-major, loaded through a second, page-level block-table
# lookup that takes a pipeline stage of its own, so it wants more stages than bf16; these
# smaller, deeper tiles measured fastest on an H200 (``kernels_bench.py --prefill-configs``).
FP8_GPU_CONFIG: dict[str, int] = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 5}
INTERPRET_CONFIG: dict[str, int] = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
_LARGE_SMEM_BYTES = 220 * 1024
# An FP8 cache on CUDA: K/V tiles widened to fp16 (one instruction per pair, exact for every e4m3
# value; e4m3 -> bf16 has no such instruction) with the query clamped into fp16's range: measured
# faster on an H200. False widens to the query's dtype, as the interpreter does.
FP8_TO_FP16 = True


@functools.cache
def _gpu_config(device_index: int, head_dim: int, elem_size: int) -> dict[str, int]:
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not (head_dim <= 128 and elem_size <= 2 and smem >= _LARGE_SMEM_BYTES):
        return GPU_SMALL_SMEM_CONFIG
    return FP8_GPU_CONFIG if elem_size == 1 else GPU_CONFIG


# Not specialised on the block-table row stride (1 at start-up profiling, the widest request's
# block count in a step): one compiled variant, none compiled while serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    work_ptr,
    scale_log2,
    window,  # keys p - window < j <= p (read when WINDOW)
    softcap,  # scores cap * tanh(s / cap) (read when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr,  # tl.float16 for an FP8 cache widened to fp16
    V_TOKEN_MAJOR: tl.constexpr,  # V blocks [kv_head, d, page] (FP8); BLOCK_N % PAGE_SIZE == 0
    PDL: tl.constexpr,
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    pdl.wait(PDL)
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(work_ptr + 2 * item)
    q0 = tl.load(work_ptr + 2 * item + 1) * BLOCK_Q
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q0 + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if COMPUTE == tl.float16 and q.dtype != tl.float16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
    q = q.to(COMPUTE)
    pos = prefix + tok  # position of each row's token in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(seq_len, prefix + q0 + BLOCK_Q)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    lo = 0
    if WINDOW:  # tiles before the first row's window hold no visible key
        lo = (tl.maximum(prefix + q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE_SIZE) * stride_co + kvh * stride_ch
        kv_off = row[:, None] + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(COMPUTE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:  # s is in log2 units: cap the natural score, tanh through the sigmoid
            x = s * 0.6931471805599453
            s = (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0) * softcap * 1.4426950408889634
        # Key 0 is visible to every row, so no row's running max stays -inf after tile 0.
        visible = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
        if WINDOW:  # ... except with a window: a row may see nothing in the first tiles
            visible &= offs_n[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if WINDOW:  # a row with nothing visible yet: exp2(-inf - -inf) would be NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_TOKEN_MAJOR:
            v = load_v_token_major(
                v_cache_ptr, bt_row, n0, hi, kvh, stride_cb, offs_d, mask_d,
                HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D,
            ).to(COMPUTE)  # fmt: skip
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(COMPUTE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if WINDOW:  # padding rows (past the chunk) may have seen no key
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_off = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :]
    )


def prefill_block_q(q: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """Query tokens per program (a work item's size) for this device, head shape and dtype."""
    return _launch_config(q, kv_cache)[1]


def _launch_config(q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[dict[str, int], int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // kv_cache.shape[3]
    if q.is_cuda:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        cfg = _gpu_config(index, head_dim, kv_cache.element_size())
    else:
        cfg = INTERPRET_CONFIG
    block_m = max(cfg["block_m"], triton.next_power_of_2(group))
    return cfg, block_m // group, block_m


def prefill_work(
    query_start_loc: list[int], seq_lens: list[int], block_q: int, skip_decode: bool
) -> np.ndarray:
    """Work items ``[n, 2]`` int32 of (request, query block), the blocks that see the most keys
    first (they take longest: starting them first shortens the tail)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    q_lens = np.diff(qsl)
    keep = q_lens > (1 if skip_decode else 0)
    reqs = np.nonzero(keep)[0]
    nblk = -(-q_lens[reqs] // block_q)
    req_of = np.repeat(reqs, nblk)
    first = np.repeat(np.cumsum(nblk) - nblk, nblk)
    blk = np.arange(req_of.size) - first
    prefix = np.asarray(seq_lens, dtype=np.int64)[req_of] - q_lens[req_of]
    order = np.argsort(-(prefix + np.minimum((blk + 1) * block_q, q_lens[req_of])), kind="stable")
    return np.stack([req_of[order], blk[order]], axis=1).astype(np.int32)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, context length incl. the new chunk
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    skip_decode: bool = False,
    work: torch.Tensor | None = None,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new chunk over its cached prefix plus the chunk.

    ``window``: a query at position p sees keys p - window < j <= p only. ``softcap``: scores
    s (after the scale) become ``softcap * tanh(s / softcap)``.

    With ``skip_decode`` the rows of single-token requests are left untouched (for a caller that
    sends them to :func:`~fulcrum.kernels.decode_attention.decode_attention`). ``work`` is
    :func:`prefill_work` on the device (built here from host copies when not given: a sync).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0 or max_query_len == 0:
        return out
    cfg, block_q, block_m = _launch_config(q, kv_cache)
    group = num_heads // num_kv_heads
    if work is None:
        items = prefill_work(query_start_loc.tolist(), seq_lens.tolist(), block_q, skip_decode)
        work = torch.from_numpy(items).to(q.device)
    if work.shape[0] == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (work.shape[0], num_kv_heads)
    fp16 = FP8_TO_FP16 and q.is_cuda and is_fp8(kv_cache.dtype)
    # Never EARLY: the mode is a compile-time constant, and a grid that crosses the SM count
    # with the prompt's length would compile a second variant at the first long prompt; the
    # kernel after this one is a cuBLAS GEMM, which an early release would not start anyway.
    m = min(pdl.mode(q, grid[0] * grid[1], pdl_cfg), pdl.WAIT)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        work,
        scale * math.log2(math.e),
        window or 0,
        softcap or 0.0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=tile_tokens(cfg["block_n"], kv_cache),
        PRECISION=dot_precision(q, kv_cache),
        COMPUTE=tl.float16 if fp16 else compute_dtype(q, kv_cache),
        V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
        PDL=m,
        WINDOW=bool(window),
        SOFTCAP=bool(softcap),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl.launch_options(m),
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch version of :func:`prefill_attention`, computed in fp32."""
    page = kv_cache.shape[2]
    group = q.shape[1] // kv_cache.shape[3]
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        blocks = block_tables[b, : (n + page - 1) // page].long()
        k = kv_cache[0][blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        v = v_rows(kv_cache)[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        s = torch.einsum("thd,nhd->htn", q[start:end].float(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        pos = torch.arange(n - (end - start), n, device=q.device)
        keys = torch.arange(n, device=q.device)[None, :]
        hidden = keys > pos[:, None]
        if window:
            hidden |= keys <= pos[:, None] - window
        s = s.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("htn,nhd->thd", s.softmax(-1), v).to(q.dtype)
    return out
