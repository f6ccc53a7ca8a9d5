"""Random sampling of logits rows without sorting the vocabulary: two launches.

The general sampler (``worker/sampler.py``) filters a row by sorting it: temperature, a sort of
the whole vocabulary, softmax, cumulative sum, scatter back, softmax again, exponential noise and
an argmax, each its own kernel: at batch 1 on an H200 that costs a sampled step about a
twelfth of its time over a greedy one.

Every filter here keeps the tokens above some threshold, so the kept set is decided token by
token from a few sums over the row, and the draw is exact by rejection (as FlashInfer's
sorting-free top-p sampling does). With ``s = logit / temperature``, ``m = max s`` and
``Z = sum exp(s - m)``::

    round 0 (_round0_kernel, SPLITS programs per row, each on a slice of the vocabulary):
            m and Z of the slice, and t = argmax over the slice of s + Gumbel noise
    then (_sample_kernel, one program per row): combine the slices: m, Z, t over the row
    loop:   accept t if s_t >= m + log(min_p),
                    and (pass B) the tokens with s > s_t number < top_k and weigh < top_p * Z
            else pivot = s_t        (t and every token below it are outside the kept set)
            (pass A) t = argmax over {s > pivot, s >= m + log(min_p)} of s + Gumbel noise

Round 0 draws from the whole row, pass A from the row restricted to the tokens above the pivot:
a superset of the kept set each time, so an accepted draw, conditioned on landing in the kept
set, is distributed as the kept set renormalised -- the same law as sorting and filtering. The
most likely token is always kept and always eligible, so the loop ends. Top-p and min-p rows
mostly accept round 0's draw; a small top-k over a flat row takes about log2(V / k) rounds (17
for top-k 1 over 128k tokens). A row rejected ``MAX_ROUNDS`` times takes its most likely token,
which the law then overweights. Spreading round 0 over ``SPLITS`` programs matters at small
batches: one program per row leaves all but one multiprocessor idle, and the noise (Philox and
two logarithms per token) is most of the work.

Semantics match the sorting sampler: top-k keeps every token tied with the k-th value; top-p
keeps a token when the mass strictly above it is below ``top_p`` (tied tokens are kept or
dropped together); min-p keeps probabilities at least ``min_p`` times the largest. Top-k
together with top-p (top-p over the top-k renormalised distribution) needs the top-k mass
and stays with the sorting sampler. A row with temperature 0 takes the first maximum.

Noise: Philox (``tl.rand4x``) keyed by the row's key and the round, one counter per four
columns (column ``4 q + j`` takes the counter ``q``'s output ``j``). Unseeded rows
take keys from torch's default generator (``random_keys``); a seeded request's key follows
from its seed and the token's position (``seeded_key``), so its tokens do not depend on the
batch it ran in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CHUNK, WARPS = 4096, 16
SPLITS, SPLIT_WARPS = 32, 8  # round 0's programs per row, and their warps
INTERPRET_CHUNK, INTERPRET_SPLITS = 512, 2
MAX_ROUNDS = 64  # rejections before a row takes its most likely token
# Keys of neighbouring rows (or positions) lie this far apart; each round adds 7,919.
KEY_STRIDE = 1_000_003
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _row_params(params_ptr, row):
    p = params_ptr + row * 6  # see pack_params
    temp = tl.load(p).to(tl.float32, bitcast=True)
    k = tl.load(p + 1).to(tl.float32, bitcast=True).to(tl.int32)
    top_p = tl.load(p + 2).to(tl.float32, bitcast=True)
    min_p = tl.load(p + 3).to(tl.float32, bitcast=True)
    lo = tl.load(p + 4).to(tl.int64) & 0xFFFFFFFF
    seed = (tl.load(p + 5).to(tl.int64) << 32) | lo
    return temp, k, top_p, min_p, seed


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2; with ``FAST`` (CUDA) the hardware's approximate one, one instruction where
    ``tl.log2`` is a software polynomial of ~20: Gumbel noise needs no more than its ~22
    correct bits. The interpreter has no such intrinsic."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _noisy_keys(s, q, ok, seed, rnd, noisy, FAST: tl.constexpr):
    """``s`` plus Gumbel noise (``-log(-log u)``) -- ``s`` itself where not ``noisy`` -- over a
    ``[QUADS, 4]`` tile of columns ``4 q + j``, -inf outside ``ok``. One Philox call draws the
    four uniforms of a row of the tile (column ``4 q + j`` takes output ``j`` of counter
    ``q``): the generator, most of the arithmetic here, runs once per four columns."""
    j = tl.arange(0, 4)[None, :]
    r0, r1, r2, r3 = tl.rand4x(seed + rnd * 7_919, q)
    u = tl.where(j < 2, tl.where(j == 0, r0[:, None], r1[:, None]),
                 tl.where(j == 2, r2[:, None], r3[:, None]))  # fmt: skip
    u = tl.maximum(u, 1.0e-30)  # u = 0 would give key -inf
    g = -LN2 * _log2(-LN2 * _log2(u, FAST), FAST)  # -ln(-ln u)
    return tl.where(ok, tl.where(noisy, s + g, s), float("-inf"))


@triton.jit
def _first_max(key, col, V):
    """The largest of a tile of keys and, among the columns ``col`` holding it, the first;
    column 0 where no key equals the largest (NaN keys)."""
    best = tl.max(tl.max(key, axis=1), axis=0)
    at = tl.min(tl.min(tl.where(key == best, col, V), axis=1), axis=0)
    return best, tl.where(at >= V, 0, at)


@triton.jit
def _round0_kernel(
    x_ptr,
    stride_x,
    params_ptr,
    part_ptr,
    V,
    SLICE,
    CHUNK: tl.constexpr,
    SKIP_GREEDY: tl.constexpr,
    FAST: tl.constexpr,
):
    """Round 0 over one slice of a row: its maximum, softmax denominator and Gumbel draw."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp, k, top_p, min_p, seed = _row_params(params_ptr, row)
    if SKIP_GREEDY:  # a greedy row keeps the argmax already written
        if temp == 0.0:
            return
    base = x_ptr + row.to(tl.int64) * stride_x
    QUADS: tl.constexpr = CHUNK // 4
    j = tl.arange(0, 4)[None, :]
    inv_t = 1.0 / tl.where(temp == 0.0, 1.0, temp)
    m = float("-inf")
    z = 0.0
    best = float("-inf")
    at = 0
    start = split * SLICE  # a multiple of CHUNK
    for c0 in range(0, SLICE, CHUNK):
        q = (start + c0) // 4 + tl.arange(0, QUADS)
        cols = q[:, None] * 4 + j
        ok = (cols < V) & (cols < start + SLICE)
        s = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(tl.max(s, axis=1), axis=0))
        e = tl.where(ok, tl.exp(s - m_new), 0.0)
        z = z * tl.exp(m - m_new) + tl.sum(tl.sum(e, axis=1), axis=0)
        m = m_new
        cm, col = _first_max(_noisy_keys(s, q, ok, seed, 0, temp != 0.0, FAST), cols, V)
        take = cm > best
        best = tl.where(take, cm, best)
        at = tl.where(take, col, at)
    out = part_ptr + (row * tl.num_programs(1) + split) * 4
    tl.store(out, m)
    tl.store(out + 1, z)
    tl.store(out + 2, best)
    tl.store(out + 3, at.to(tl.float32))  # exact below 2**24


@triton.jit
def _sample_kernel(
    x_ptr,
    stride_x,
    params_ptr,
    part_ptr,
    out_ptr,
    V,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
    SKIP_GREEDY: tl.constexpr,
    FAST: tl.constexpr,
):
    """Round 0's slices combined, its draw checked; later rounds over the whole row."""
    row = tl.program_id(0)
    temp, k, top_p, min_p, seed = _row_params(params_ptr, row)
    if SKIP_GREEDY:
        if temp == 0.0:
            return
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, CHUNK)
    QUADS: tl.constexpr = CHUNK // 4
    j = tl.arange(0, 4)[None, :]
    inv_t = 1.0 / tl.where(temp == 0.0, 1.0, temp)
    k = tl.where((k <= 0) | (k >= V), V, k)
    part = part_ptr + (row * SPLITS + tl.arange(0, SPLITS)) * 4
    ms = tl.load(part)
    m = tl.max(ms, axis=0)
    z = tl.sum(tl.where(ms > float("-inf"), tl.load(part + 1) * tl.exp(ms - m), 0.0), axis=0)
    best, which = tl.max(
        tl.load(part + 2), axis=0, return_indices=True, return_indices_tie_break_left=True
    )
    at = tl.load(part_ptr + (row * SPLITS + which) * 4 + 3).to(tl.int32)
    floor = tl.where(min_p > 0.0, m + tl.log(tl.maximum(min_p, 1.0e-30)), float("-inf"))
    check = (k < V) | (top_p < 1.0)

    pivot = float("-inf")
    done = 0
    rnd = 0
    while done == 0:
        # past MAX_ROUNDS rejections, the most likely token (always kept) without noise
        noisy = (temp != 0.0) & (rnd < MAX_ROUNDS)
        if rnd > 0:  # pass A: one draw among the eligible tokens (Gumbel-max)
            # each lane keeps its own best key and column; one reduction after the loop
            best_v = tl.full([QUADS, 4], float("-inf"), dtype=tl.float32)
            at_v = tl.zeros([QUADS, 4], dtype=tl.int32)
            for c0 in range(0, V, CHUNK):
                q = c0 // 4 + tl.arange(0, QUADS)
                cols = q[:, None] * 4 + j
                s = tl.load(base + cols, mask=cols < V, other=float("-inf"))
                s = s.to(tl.float32) * inv_t
                ok = (s > pivot) & (s >= floor) & (cols < V)
                key = _noisy_keys(s, q, ok, seed, rnd, noisy, FAST)
                take = key > best_v  # strictly: a lane's earlier column wins a tie
                best_v = tl.where(take, key, best_v)
                at_v = tl.where(take, cols, at_v)
            best, at = _first_max(best_v, at_v, V)
        s_at = tl.load(base + at).to(tl.float32) * inv_t
        if (noisy == 0) | (best == float("-inf")):  # -inf: nothing eligible (NaN logits)
            done = 1
        elif s_at < floor:  # round 0 drew below min-p: it and every token below are out
            pivot = s_at
        elif check == 0:
            done = 1
        else:
            # pass B: count and mass of the tokens strictly above the draw, summed per lane
            # and reduced once after the loop (a reduction per tile stalls a lone program)
            count_v = tl.zeros([CHUNK], dtype=tl.int32)
            mass_v = tl.zeros([CHUNK], dtype=tl.float32)
            for c0 in range(0, V, CHUNK):
                s = tl.load(base + c0 + offs, mask=c0 + offs < V, other=float("-inf"))
                s = s.to(tl.float32) * inv_t
                above = s > s_at
                count_v += above.to(tl.int32)
                mass_v += tl.where(above, tl.exp(s - m), 0.0)
            count = tl.sum(count_v, axis=0)
            mass = tl.sum(mass_v, axis=0)
            if (count < k) & (mass < top_p * z):
                done = 1
            else:
                pivot = s_at
        rnd += 1
    tl.store(out_ptr + row, at.to(tl.int64))


def pack_params(rows: Sequence[Sequence[float]], keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """The kernel's per-row parameters, ``[n, 6]`` int32: temperature, top-k, top-p and min-p
    as float32 bits, then the row's noise key (int64, in [0, 2**62)) in the last two."""
    n = len(rows)
    buf = np.zeros((n, 6), dtype=np.int32)
    if n:
        buf[:, :4].view(np.float32)[:] = np.asarray(rows, dtype=np.float32)
        buf[:, 4:].view(np.int64)[:, 0] = np.asarray(keys, dtype=np.int64)
    return buf


def random_keys(n: int) -> np.ndarray:
    """Noise keys for ``n`` unseeded rows: a fresh draw from torch's default generator (so
    ``torch.manual_seed`` repeats a run), then one stream per row."""
    base = int(torch.randint(0, 2**61, (1,)).item())
    return base + np.arange(n, dtype=np.int64) * KEY_STRIDE


def seeded_key(seed: int, index: int, position: int) -> int:
    """The noise key of a seeded request's token at ``position`` (``index``: its place among
    the request's ``n`` samples): the same whatever the batch, the step or the schedule."""
    mixed = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**61
    return (mixed + position * KEY_STRIDE) % 2**61


def sample_rows(
    logits: torch.Tensor,
    params: torch.Tensor,
    out: torch.Tensor | None = None,
    skip_greedy: bool = False,
) -> torch.Tensor:
    """One token id per row of ``logits [n, V]`` (any float dtype, unit column stride).

    ``params``: ``pack_params``' ``[n, 6]`` int32 on the logits' device; per row temperature
    (0 = greedy), top-k (<= 0 or >= V: off), top-p (1 = off), min-p (0 = off) and the noise
    key. A row must not set both top-k and top-p. ``skip_greedy``: rows of temperature 0 are
    left as ``out`` holds them (the argmax a decode graph wrote there) instead of computed."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("sample_rows: logits need unit column stride")
    if params.shape != (n, 6) or params.dtype != torch.int32 or not params.is_contiguous():
        raise ValueError(f"sample_rows: params must be pack_params' contiguous int32 [{n}, 6]")
    if params.device != logits.device:
        raise ValueError(f"sample_rows: params must be on {logits.device}")
    if out is None:
        if skip_greedy:
            raise ValueError("sample_rows: skip_greedy leaves rows as out holds them: pass out")
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    cuda = logits.is_cuda
    splits = SPLITS if cuda else INTERPRET_SPLITS
    per_split = triton.cdiv(vocab, splits)
    # tiles of at least one row of four columns (``_noisy_keys``)
    chunk0 = max(4, min(CHUNK if cuda else INTERPRET_CHUNK, triton.next_power_of_2(per_split)))
    part = torch.empty((n, splits, 4), dtype=torch.float32, device=logits.device)
    _round0_kernel[(n, splits)](
        logits,
        logits.stride(0),
        params,
        part,
        vocab,
        triton.cdiv(per_split, chunk0) * chunk0,
        CHUNK=chunk0,
        SKIP_GREEDY=skip_greedy,
        FAST=cuda,
        num_warps=SPLIT_WARPS if cuda else 1,
    )
    _sample_kernel[(n,)](
        logits,
        logits.stride(0),
        params,
        part,
        out,
        vocab,
        SPLITS=splits,
        CHUNK=max(4, min(CHUNK if cuda else INTERPRET_CHUNK, triton.next_power_of_2(vocab))),
        MAX_ROUNDS=MAX_ROUNDS,
        SKIP_GREEDY=skip_greedy,
        FAST=cuda,
        num_warps=WARPS if cuda else 1,
    )
    return out
