"""The packed integer weight layout shared by the W4A16 kernels, its torch reference, and the
Triton tile helpers and launch rules the GEMV (``w4a16_gemv.py``), the GEMM (``w4a16.py``) and
the GGUF K-quant kernels (``kquant.py``) share.

The layout (``quant/int4.py`` repacks GPTQ and AWQ checkpoints into it once at load)::

    qweight  int32 [K / PACK, N]   PACK = 32 / BITS values of consecutive input rows k per word,
                                   row k at bits (k % PACK) * BITS of word k // PACK
    zeros    uint8 [G, N]          (int16 where a zero is 256) zero point of group g = k // GROUP (G = K / GROUP)
    scales   fp16/bf16/fp32 [G, N]
    mins     optional, as scales   (GGUF Q4_1's additive term; zeros then 0)
    w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] (+ mins[g, n])  (fp32)

An act-order (``desc_act``) checkpoint's rows are permuted at load so that groups are
contiguous; the caller permutes x's columns the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``int32 [K / PACK, N]`` -> ``int32 [K, N]`` values in ``[0, 2**bits)``."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(-1, qweight.shape[1]) if pack > 1 else q[:, 0]


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rows`: ``[K, N]`` values -> ``int32 [K / PACK, N]``."""
    pack = 32 // bits
    k, n = q.shape
    q = q.to(torch.int32).reshape(k // pack, pack, n)
    out = torch.zeros(k // pack, n, dtype=torch.int32, device=q.device)
    for j in range(pack):
        out |= q[:, j, :] << (j * bits)
    return out


def dequantize(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[K, N]`` in fp32, computed as the kernels compute it (the torch path)."""
    q = unpack_rows(qweight, bits)
    g = torch.arange(q.shape[0], device=q.device) // group
    w = (q - zeros.to(torch.int32)[g]).float() * scales.float()[g]
    return w if mins is None else w + mins.float()[g]


def dequantize_t(
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dequantize(...).t()`` made contiguous (``[N, K]``, ``F.linear``'s layout), built in
    that layout with broadcasts over whole groups and in-place steps: the CPU path's cost."""
    n = qweight.shape[1]
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    words = qweight.t().contiguous()  # an eighth of the weight: makes the result [N, K] row-major
    q = (words[:, :, None] >> shifts).bitwise_and_((1 << bits) - 1)  # [N, K / P, P]
    q = q.view(n, -1, group)  # [N, G, group]
    q.sub_(zeros.t().to(torch.int32)[:, :, None])
    w = q.float().mul_(scales.t().float()[:, :, None])
    if mins is not None:
        w.add_(mins.t().float()[:, :, None])
    return w.view(n, -1)


def reference_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    bits: int,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize, then matmul in fp32: what both kernels must equal."""
    y = x.float() @ dequantize(qweight, zeros, scales, group, bits, mins)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def int_minus(q, zf):
    """``q - zf`` in fp32 for int32 ``q`` in ``[0, 2**23)`` and integral ``zf`` (fp32, under
    2**23), without an integer-to-float conversion per weight: that conversion is a slow
    instruction and bounds the GEMV once the packed words stream at full bandwidth. q's bits
    OR'd into the mantissa of 2**23 give the float 2**23 + q exactly, and one subtraction of
    2**23 + zf (exact: both under 2**24) leaves q - zf, bit for bit what the conversion gives."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (zf + 8388608.0)


@triton.jit
def dequant_tile(qw_ptr, z_ptr, s_ptr, m_ptr, k, offs_n, mask_k, mask_n, k0, K, stride_q, stride_z,
                  stride_s, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MIN: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows ``k`` x columns ``offs_n`` of the weight, dequantized to fp32 ``[BLOCK_K, BLOCK_N]``."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = mask_k[:, None] & mask_n[None, :]
    # Each packed word loaded once, then spread over its PACK rows: words [BLOCK_K / PACK, N]
    # -> [BLOCK_K / PACK, PACK, N] -> rows k0 .. k0 + BLOCK_K (row-major: word i, value j).
    rows = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    mask_w = (rows < K // PACK)[:, None] & mask_n[None, :]
    qw = tl.load(qw_ptr + rows[:, None] * stride_q + offs_n[None, :], mask=mask_w, other=0)
    # Values become floats as in ``int_minus``, but masked in place: a value at bit ``pos``
    # under an exponent that makes its unit 1 is the float 2**(23 - pos) + q (values above
    # mantissa bit 22 are shifted down 16 bits first), which saves the shift per value.
    j = tl.arange(0, PACK)
    sh = tl.where(BITS * (j + 1) > 23, 16, 0)
    pos = BITS * j - sh
    expo = (150 - pos) << 23  # float bits of 2**(23 - pos)
    bits = ((qw[:, None, :] >> sh[None, :, None]) & (MASK << pos)[None, :, None]) | expo[None, :, None]
    v = bits.to(tl.float32, bitcast=True)  # [BLOCK_K / PACK, PACK, BLOCK_N]: 2**(23 - pos) + q
    base = expo.to(tl.float32, bitcast=True)[None, :, None]
    if GROUP % BLOCK_K == 0:  # the whole tile in one group: one row of zeros and scales
        g = k0 // GROUP
        z = tl.load(z_ptr + g * stride_z + offs_n, mask=mask_n, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = tl.reshape((v - (base + z[None, None, :])) * s[None, None, :], [BLOCK_K, BLOCK_N])
        if HAS_MIN:
            mn = tl.load(m_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        g = (k // GROUP)[:, None]
        z = tl.load(z_ptr + g * stride_z + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + g * stride_s + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        w = (tl.reshape(v - base, [BLOCK_K, BLOCK_N]) - z) * s
        if HAS_MIN:
            mn = tl.load(m_ptr + g * stride_s + offs_n[None, :], mask=mask, other=0.0)
    if HAS_MIN:
        w += mn.to(tl.float32)
    return w


@triton.jit
def gemv_step(acc1, acc, w, x_ptr, k, mask_k, offs_m, mask_m, stride_xm, BLOCK_M: tl.constexpr):
    """Add rows ``k`` of x times the weight tile ``w`` (fp32 ``[BLOCK_K, BLOCK_N]``): one row
    into ``acc1`` elementwise (reduced once at the end by :func:`store_tile`), more into ``acc``."""
    if BLOCK_M == 1:
        acc1 += w * tl.load(x_ptr + k, mask=mask_k, other=0.0).to(tl.float32)[:, None]
    else:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc1, acc


@triton.jit
def store_tile(acc1, acc, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, ROW_SUM: tl.constexpr):  # fmt: skip
    """``acc`` (or, with ``ROW_SUM`` and one row, ``acc1`` summed over K) plus the bias, stored."""
    if ROW_SUM:
        if BLOCK_M == 1:
            acc = tl.sum(acc1, axis=0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def split_arrive(acc, ws_ptr, cnt_ptr, offs, mask, size, strip, split, SPLIT: tl.constexpr):
    """Split-K inside the kernel, first half: this program stores its fp32 partial sums
    ``acc`` at ``ws[split] + offs`` (``size`` values a split) and counts itself done on its
    output tile's counter (``strip``). True for the tile's last program, which then takes the
    sum (:func:`split_total`). The barrier puts every thread's stores before the count (one
    thread's release, as CUTLASS's semaphore)."""
    tl.store(ws_ptr + split * size + offs, acc, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + strip, 1, sem="acq_rel", scope="gpu")
    return done == SPLIT - 1


@triton.jit
def split_total(acc, ws_ptr, cnt_ptr, offs, mask, size, strip, SPLIT: tl.constexpr):
    """The tile's last program: the SPLIT partials added in split order (the same sums
    whichever program finishes last; ``acc`` gives the shape), and the counter reset for the
    next launch. The partials are read past L1, which may hold lines of the same workspace
    from an earlier launch."""
    total = tl.zeros_like(acc)
    for s in tl.static_range(SPLIT):
        total += tl.load(ws_ptr + s * size + offs, mask=mask, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(cnt_ptr + strip, 0)
    return total


@triton.jit
def split_fixup(acc, ws_ptr, cnt_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
                stride_om, strip, split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Split-K's sum inside the kernel (``acc``: ``[BLOCK_M, BLOCK_N]``, the workspace
    ``[SPLIT, M, N]``): the tile's last program adds the partials, adds the bias and stores
    the output. A separate sum would cost a launch and a pass over the partials per linear,
    most of a narrow layer's time at batch 1."""
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if split_arrive(acc, ws_ptr, cnt_ptr, offs, mask, M * N, strip, split, SPLIT):
        total = split_total(acc, ws_ptr, cnt_ptr, offs, mask, M * N, strip, SPLIT)
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=mask)


def fit_block_k(block_k: int, k: int, group: int) -> int:
    """A K tile inside one group where the group is a power of two (one row of scales and zeros
    per tile instead of one per weight row)."""
    block_k = min(block_k, triton.next_power_of_2(k))
    return group if group < block_k and group & (group - 1) == 0 else block_k


def check(x, qweight, zeros, scales, mins, group: int, bits: int) -> tuple[int, int, int]:
    m, k = x.shape
    n = qweight.shape[1]
    if bits not in (4, 8) or qweight.shape[0] * (32 // bits) != k or k % group:
        raise ValueError(
            f"w4a16: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, bits {bits}, "
            f"group {group} do not fit"
        )
    g = k // group
    assert (
        zeros.shape == (g, n)
        and scales.shape == (g, n)
        and zeros.dtype in (torch.uint8, torch.int16)
    )
    assert mins is None or (mins.shape == scales.shape and mins.stride() == scales.stride())
    assert qweight.dtype == torch.int32 and qweight.stride(-1) == 1 and x.stride(-1) == 1
    return m, n, k


def check_operands(x, qweight, zeros, scales, mins, group, bits) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with unit stride along K, checked against the packed weight, and the output."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, n, _ = check(x, qweight, zeros, scales, mins, group, bits)
    return x, torch.empty((m, n), dtype=x.dtype, device=x.device)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The device's split-K counters, one per output tile, all zero between launches (each
    tile's last program resets its own). Launches on one stream run one after another, so one
    set serves every layer. A larger set, where one is ever needed, joins the older ones
    rather than replacing them: CUDA graphs captured earlier keep their addresses."""
    sets = _COUNTERS.setdefault(device, [])
    if not sets or sets[-1].numel() < programs:
        sets.append(torch.zeros(max(programs, 1 << 14), dtype=torch.int32, device=device))
    return sets[-1]


def auto_split(
    k: int, programs: int, block_k: int, sms: int, per_sm: int = 8, min_tiles: int = 4,
    max_split: int = 1 << 30,
) -> int:
    """Split K (a power of two) until about ``per_sm`` programs per SM stream the weight: one
    program per strip of N columns leaves a narrow layer (N = 4,096 at a 32-column strip: 128
    programs) with one program per SM, too few loads in flight to draw HBM's bandwidth. Each
    split keeps at least ``min_tiles`` K tiles, and K must divide evenly.
    ``benchmarks/w4a16_bench.py`` sweeps ``split_k``; BENCHMARKS.md gives the figures this rule
    was read from."""
    split = 1
    while (
        programs * split < per_sm * sms
        and 2 * split <= max_split
        and k % (2 * split * block_k) == 0
        and k // (2 * split) >= min_tiles * block_k
    ):
        split *= 2
    return split
