"""Paged decode attention (one new query token per request), split-KV ("flash decoding").

Stage 1 runs one program per (request, kv head, split). The program owns all ``GROUP`` query
heads that share its kv head (GQA), padded to a 16-row tile so ``tl.dot`` applies, and walks its
slice of the context ``BLOCK_N`` tokens at a time, loading each K/V row once::

    context of request b (seq_len tokens), NUM_SPLITS = 4:
    |<-- split 0 -->|<-- split 1 -->|<-- split 2 -->|<- split 3 ->|   split_len = round_up(
    [n0 .. n0+BLOCK_N) tiles; token n -> block_tables[b, n // page] at n % page    cdiv(seq_len,
                                                                                  S), BLOCK_N)
    q tile [BLOCK_G >= 16, D]: rows g < GROUP are heads kvh*GROUP + g, the rest are zero padding

Each program writes its normalized partial output and its log-sum-exp (base 2) to scratch;
a split past the end of a short context writes lse = -inf. Stage 2 (one program per (request,
query head)) combines the splits: ``out = sum_s 2^(lse_s - M) * o_s / sum_s 2^(lse_s - M)``.
With a single split, stage 1 writes the final rows itself and stage 2 is not launched. At a few
requests (``AttentionKernelConfig.combine_max_reqs``) stage 2 is not launched either: each
split program counts itself done on its (request, kv head) counter, and the last one combines
that head group's splits in split order and resets the counter: at batch 1 the reduce kernel
reads ~0.5 MB a layer, so its launch and ramp are most of its time.

With ``order`` (a permutation of the requests, longest context first), program row ``i`` serves
request ``order[i]``: programs start roughly in grid order, so the ones still running at the end
of the kernel are short.

Rows are found through ``query_start_loc``: request ``b`` owns query row ``query_start_loc[b]``
and is skipped unless its query length is exactly 1, so this kernel can serve the decode rows of
a mixed batch. The grid depends only on ``num_reqs`` and the split count, and nothing here syncs
with the host, so the whole call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fulcrum.config import AttentionKernelConfig, PdlConfig
from fulcrum.kernels import pdl
from fulcrum.kernels.kv_dtype import (
    compute_dtype,
    dot_precision,
    load_v_token_major,
    tile_tokens,
)
from fulcrum.kv_cache.dtype import is_fp8, v_rows, v_token_major

# The reduce kernel's tile over splits: no launch splits a context more ways than this.
MAX_SPLITS = 32
# The launch policy comes from ``KernelConfig.attention`` (``AttentionKernelConfig``):
#   max_splits         the split count's cap (default_num_splits), at most MAX_SPLITS
#   pre_wait_max_reqs  up to this many requests (the latency-bound single-stream steps) a split
#                      program reads the step's inputs -- its request's row, length and first
#                      blocks -- before waiting for the kernel that writes q: those reads leave
#                      the step's critical path; larger batches keep the loop tuned for them.
#                      Measured faster on an H200 at batch 1, bf16 and FP8 alike.
#   split_early        there, the split grid of a 16-bit cache (e.g. 32 splits x 8 kv heads at
#                      batch 1: 256 programs, all resident at once at 4 per multiprocessor) also
#                      lets the next kernel (the reduce, or after combine_max_reqs's in-kernel
#                      combine the one after attention) launch before its own wait, so that
#                      launch hides behind the splits. An FP8 cache's deeper pipeline fits fewer
#                      programs per multiprocessor and measured slower releasing early, so it
#                      keeps the plain launch.
#   combine_max_reqs   up to this many requests no reduce kernel runs: each head group's last
#                      split program combines the splits (see above).
#   min_split_tokens   a split takes at least this many tokens (rounded up to the tile), so a
#                      short context runs on fewer, longer programs while a long one still
#                      spreads over every split: the split count stays a function of the batch
#                      shape (graph-safe) and the context decides how many of them work.
DEFAULT_CONFIG = AttentionKernelConfig()
# How an FP8 cache's tiles meet the tensor cores on CUDA:
#   "widen"  K/V widened to the query's dtype (bf16: e4m3 -> bf16 has no single instruction)
#   "fp16"   K/V widened to fp16 (one instruction per pair; exact: every e4m3 value is an fp16
#            value), the query clamped to fp16's range, weights p in fp16
#   "fp8"    query clamped into e4m3, p scaled by 256 into e4m3, FP8 tensor-core products
FP8_MODES = {"widen": 0, "fp16": 1, "fp8": 2}
FP8_MODE = "fp16"
# Launch parameters on CUDA (tuned on an H200 with benchmarks/kernels_bench.py) and in the
# interpreter, where small tiles keep tests quick. ``maxnreg`` (optional, for sweeps) caps
# registers per thread so more programs fit on a multiprocessor (ptxas takes ~200 here); on the
# H200 every cap tried (96, 128) was slower: the spills cost more than the occupancy gained.
GPU_CONFIG: dict[str, int] = {"block_n": 64, "num_warps": 2, "num_stages": 3}
# An FP8 cache: tiles of half the bytes want a deeper pipeline (the block-table loads take a stage
# of their own, so 6 stages keep two K/V tiles in flight); measured fastest on an H200 at batches
# 64-384 over 1,000-2,000-token contexts.
FP8_GPU_CONFIG: dict[str, int] = {"block_n": 64, "num_warps": 2, "num_stages": 6}
INTERPRET_CONFIG: dict[str, int] = {"block_n": 16, "num_warps": 4, "num_stages": 1}


# The split count and the strides that scale with it are runtime values that Triton must not
# specialise on: a CUDA graph per batch bucket would otherwise compile a variant per count.
# The block-table row stride is 1 in the start-up profiling step, a multiple of 16 in the decode
# graphs and anything in eager steps (the widest request's block count): unspecialised, one
# compiled variant serves them all instead of a compile at the first few requests.
@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_plh", "stride_bt"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    order_ptr,  # [R] request per program row (longest first), read when HAS_ORDER
    out_ptr,  # [T, Hq, D]: written directly when NUM_SPLITS == 1
    part_out_ptr,  # [R, Hq, S, D] fp32
    part_lse_ptr,  # [R, Hq, S] fp32
    scale_log2,
    window,  # keys j >= seq_len - window only (read when WINDOW)
    softcap,  # scores cap * tanh(s / cap) (read when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_bt,
    stride_por,
    stride_poh,
    stride_pos,
    stride_plr,
    stride_plh,
    num_splits,
    min_split,  # fewest tokens a split takes (a multiple of BLOCK_N); splits past the end idle
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr,
    FP8_MODE: tl.constexpr,  # FP8_MODES; 0 for any other cache dtype
    HAS_ORDER: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,  # V blocks [kv_head, d, page] (FP8); BLOCK_N % PAGE_SIZE == 0
    PRE_WAIT: tl.constexpr,  # read the step's inputs and the first tile's blocks before the wait
    PDL: tl.constexpr,
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    COMBINE: tl.constexpr = False,  # SPLIT: the last split program of a head group combines
    cnt_ptr=None,  # [R * kv heads] int32 counters, zero between launches (COMBINE)
    num_kv_heads=1,
):
    if not PRE_WAIT:
        pdl.wait(PDL)
    b = tl.program_id(0)
    if HAS_ORDER:
        b = tl.load(order_ptr + b).to(tl.int32)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(qsl_ptr + b)
    is_decode = tl.load(qsl_ptr + b + 1) - q_row == 1
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if PRE_WAIT:  # the step's inputs come from the host, before any kernel of the step: no
        # kernel before this one writes them, so their loads need not wait (``kernels/pdl.py``)
        offs_n0 = start + tl.arange(0, BLOCK_N)
        blk0 = tl.load(bt_row + offs_n0 // PAGE_SIZE, mask=offs_n0 < end, other=0).to(tl.int64)
        pdl.wait(PDL)
    if not is_decode:
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_off = q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if FP8_MODE == 1:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif FP8_MODE == 2:
        q = tl.clamp(q.to(tl.float32), -448.0, 448.0).to(k_cache_ptr.dtype.element_ty)
    else:
        q = q.to(COMPUTE)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    lo = start
    if WINDOW:  # start at the tile holding the window's first key: every tile run has one
        lo = tl.maximum(start, (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if WINDOW:
            mask_n &= offs_n >= seq_len - window
        if PRE_WAIT:  # the first tile's blocks were read before the wait
            first = n0 == start
            blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n & ~first, other=0)
            blk = tl.where(first, blk0, blk.to(tl.int64))
        else:
            blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE_SIZE) * stride_co + kvh * stride_ch
        kv_off = row[:, None] + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8_MODE != 2:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if SOFTCAP:  # s is in log2 units: cap the natural score, tanh through the sigmoid
            x = s * 0.6931471805599453
            s = (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0) * softcap * 1.4426950408889634
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_TOKEN_MAJOR:
            v = load_v_token_major(
                v_cache_ptr, bt_row, n0, end, kvh, stride_cb, offs_d, mask_d,
                HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_D,
            )  # fmt: skip
        else:
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8_MODE == 2:  # p in [0, 1] scaled by 256 so small weights keep FP8 precision
            pv = tl.dot((p * 256.0).to(v.dtype), v) * (1.0 / 256.0)
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_mask = mask_g[:, None] & mask_d[None, :]
    if not SPLIT:  # nothing to combine: write the final rows, no reduce launch
        dst = q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        base_o = b.to(tl.int64) * stride_por + heads * stride_poh + split * stride_pos
        tl.store(part_out_ptr + base_o[:, None] + offs_d[None, :], out, mask=o_mask)
        base_l = b.to(tl.int64) * stride_plr + heads * stride_plh + split
        tl.store(part_lse_ptr + base_l, lse, mask=mask_g)
        if COMBINE:
            _combine_last(
                out_ptr, part_out_ptr, part_lse_ptr, cnt_ptr + b * num_kv_heads + kvh,
                q_row, b, heads, offs_d, mask_g, o_mask, stride_ot, stride_oh, stride_por,
                stride_poh, stride_pos, stride_plr, stride_plh, num_splits, BLOCK_G, BLOCK_D,
            )  # fmt: skip


@triton.jit
def _combine_last(out_ptr, part_out_ptr, part_lse_ptr, cnt_ptr, q_row, b, heads, offs_d,
                  mask_g, o_mask, stride_ot, stride_oh, stride_por, stride_poh, stride_pos,
                  stride_plr, stride_plh, num_splits, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    """Stage 2 inside stage 1 for one head group: this program counts itself done; the group's
    last program weighs the splits' partial outputs by their log-sum-exps (as the reduce
    kernel does), writes the final rows and resets the counter. The barrier puts every
    thread's partial stores before the count (as ``w4a16_common.split_arrive``); the last
    program reads the partials past L1, which may hold lines of an earlier launch's."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:
        lse_row = b.to(tl.int64) * stride_plr + heads * stride_plh
        m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for s in range(num_splits):
            lse = tl.load(part_lse_ptr + lse_row + s, mask=mask_g, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            m = tl.maximum(m, lse)
        m = tl.where(m == float("-inf"), 0.0, m)  # empty context: every weight is 0
        o_row = b.to(tl.int64) * stride_por + heads * stride_poh
        den = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for s in range(num_splits):
            lse = tl.load(part_lse_ptr + lse_row + s, mask=mask_g, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            w = tl.exp2(lse - m)
            o = tl.load(part_out_ptr + (o_row + s * stride_pos)[:, None] + offs_d[None, :],
                        mask=o_mask, other=0.0, cache_modifier=".cg")  # fmt: skip
            den += w
            acc += w[:, None] * o
        res = acc / tl.where(den > 0.0, den, 1.0)[:, None]
        dst = q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + dst, res.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.atomic_xchg(cnt_ptr, 0)


@triton.jit(do_not_specialize=["num_splits", "stride_plh"])
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    stride_por,
    stride_poh,
    stride_pos,
    stride_plr,
    stride_plh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(qsl_ptr + b)  # a step input from the host: read before the wait
    is_decode = tl.load(qsl_ptr + b + 1) - q_row == 1
    pdl.wait(PDL)
    if not is_decode:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse_off = b.to(tl.int64) * stride_plr + h * stride_plh + offs_s
    lse = tl.load(part_lse_ptr + lse_off, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty context: every weight is 0
    w = tl.exp2(lse - m)
    o_off = b.to(tl.int64) * stride_por + h * stride_poh
    o_off = o_off + offs_s[:, None] * stride_pos + offs_d[None, :]
    o = tl.load(part_out_ptr + o_off, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0.0, den, 1.0)
    dst = out_ptr + q_row.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=mask_d)


class DecodeWorkspace:
    """Reusable fp32 scratch for the split-KV partials.

    It grows and never shrinks. A buffer it outgrows is kept alive, because a captured CUDA graph
    may still point at it; run one eager step at the largest batch before capturing graphs so
    capture itself never allocates.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # of the current _buf
        self._counters: torch.Tensor | None = None

    def counters(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` int32 counters for the in-kernel combine, zero between launches (the last
        program of each head group resets its own). Layers run one after another, so one set
        serves them all; like the scratch, a set outgrown is kept for graphs holding it. The
        first set is allocated with room to spare so that capturing a small batch's graph
        does not allocate one."""
        cnt = self._counters
        if cnt is None or cnt.numel() < n or cnt.device != torch.device(device):
            if cnt is not None:
                self._retired.append(cnt)
            cnt = self._counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        return cnt

    def get(
        self, num_reqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (num_reqs, num_heads, num_splits, head_dim, device)
        views = self._views.get(key)  # every layer of a step asks for the same shape
        if views is not None:
            return views
        n_out = num_reqs * num_heads * num_splits * head_dim
        n_lse = num_reqs * num_heads * num_splits
        need = n_out + n_lse
        buf = self._buf
        if buf is None or buf.numel() < need or buf.device != torch.device(device):
            if buf is not None:
                self._retired.append(buf)
            buf = torch.empty(need, dtype=torch.float32, device=device)
            self._buf = buf
            self._views.clear()
        part_out = buf[:n_out].view(num_reqs, num_heads, num_splits, head_dim)
        part_lse = buf[n_out:need].view(num_reqs, num_heads, num_splits)
        self._views[key] = (part_out, part_lse)
        return part_out, part_lse


def default_num_splits(
    num_reqs: int, num_kv_heads: int, device: torch.device, max_splits: int = MAX_SPLITS
) -> int:
    """Splits per (request, kv head): enough programs to cover every SM about twice.

    Measured on an H200 at Llama-8B shapes (8 kv heads): batch >= 64 runs fastest unsplit
    (4.1 TB/s at 4k context), batch 16 wants 4, batch 8 wants 8, batch 1 wants 16-32.

    Depends only on the batch shape (never on sequence lengths), so a CUDA graph captured at one
    batch size stays valid for any context lengths.
    """
    if device.type != "cuda":
        return 2
    sms = pdl.sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = math.ceil(2 * sms / max(1, num_reqs * num_kv_heads))
    return max(1, min(max_splits, triton.next_power_of_2(want)))


def decode_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    query_start_loc: torch.Tensor | None = None,  # [num_reqs + 1] int32; None: row b = request b
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    order: torch.Tensor | None = None,  # [num_reqs] int: a permutation, longest contexts first
    min_split_tokens: int | None = None,  # None: cfg.min_split_tokens on CUDA, 0 elsewhere
    cfg: AttentionKernelConfig = DEFAULT_CONFIG,
    pdl_cfg: PdlConfig = pdl.DEFAULT,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each single-token request's query over its whole paged context (its last
    ``window`` keys with a window; scores soft-capped as ``softcap * tanh(s / softcap)``).

    Only rows of requests whose query length is 1 are written; other rows of ``out`` are left
    as they were (so a mixed batch can run this and the prefill kernel into one ``out``).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    if query_start_loc is None:
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=q.device)
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, num_kv_heads, q.device, cfg.max_splits)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]"
    workspace = workspace or DecodeWorkspace()
    part_out, part_lse = workspace.get(num_reqs, num_heads, num_splits, head_dim, q.device)
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    tiles = INTERPRET_CONFIG
    if q.is_cuda:
        tiles = FP8_GPU_CONFIG if is_fp8(kv_cache.dtype) else GPU_CONFIG
    block_n = tile_tokens(tiles["block_n"], kv_cache)
    if min_split_tokens is None:
        min_split_tokens = cfg.min_split_tokens if q.is_cuda else 0
    min_split = -(-min_split_tokens // block_n) * block_n
    small = num_splits > 1 and num_reqs <= cfg.pre_wait_max_reqs
    combine = num_splits > 1 and num_reqs <= cfg.combine_max_reqs
    # Releasing early lets the next kernel launch during the splits: the reduce, or with the
    # combine in the splits the kernel after attention (o_proj's GEMV, its first weight tile).
    early = small and cfg.split_early and not is_fp8(kv_cache.dtype)
    m = pdl.mode(q, num_reqs * num_kv_heads * num_splits, pdl_cfg, early=early)
    counters = workspace.counters(num_reqs * num_kv_heads, q.device) if combine else None
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        order if order is not None else query_start_loc,
        out,
        part_out,
        part_lse,
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
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        num_splits,
        min_split,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        SPLIT=num_splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        PRECISION=dot_precision(q, kv_cache),
        COMPUTE=compute_dtype(q, kv_cache),
        FP8_MODE=FP8_MODES[FP8_MODE] if is_fp8(kv_cache.dtype) and q.is_cuda else 0,
        HAS_ORDER=order is not None,
        V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
        PRE_WAIT=small,
        PDL=m,
        WINDOW=bool(window),
        SOFTCAP=bool(softcap),
        COMBINE=combine,
        cnt_ptr=counters,
        num_kv_heads=num_kv_heads,
        num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"],
        maxnreg=tiles.get("maxnreg"),
        **pdl.launch_options(m),
    )
    if num_splits == 1 or combine:
        return out
    m = pdl.mode(q, num_reqs * num_heads, pdl_cfg)
    _decode_reduce_kernel[(num_reqs, num_heads)](
        out,
        part_out,
        part_lse,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=m,
        num_warps=4 if head_dim >= 128 else 2,
        **pdl.launch_options(m),
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch version of :func:`decode_attention` (row b = request b), computed in fp32."""
    page = kv_cache.shape[2]
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    out = torch.empty_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[b, : (n + page - 1) // page].long()
        k = kv_cache[0][blocks].flatten(0, 1)[:n].float()  # [n, Hkv, D]
        v = v_rows(kv_cache)[blocks].flatten(0, 1)[:n].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[:, : max(n - window, 0)] = float("-inf")
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
