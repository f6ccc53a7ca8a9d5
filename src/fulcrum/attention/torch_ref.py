"""Reference paged attention in plain torch: runs on CPU and CUDA, defines correct behaviour.

Decodes (query_len == 1) are batched into one SDPA call over the gathered blocks; each request
with a longer query (a prefill chunk, or speculative tokens) gets its own causal SDPA call — on
the new K/V directly when nothing is cached before it, through GQA without copies of K/V when
the query is a few tokens (a verify step). Index tensors and masks are built once
per step (on the first layer) and reused by the other layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from fulcrum.config import KernelConfig
from fulcrum.kv_cache.dtype import v_token_major, write_rows, write_v_rows

# A request with at most this many query tokens over a cached prefix (a verify step) attends
# like a decode: K/V gathered into the shared scratch, the KV heads shared through SDPA's GQA
# (no copies of K/V per query head), which costs less than the expanded contiguous copies that
# a long prefill chunk needs for SDPA's fast kernel.
_FEW_QUERIES = 16


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Scatter new K/V rows into the paged cache (slots < 0 are padding and skipped)."""
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, nb * bs, kv_cache.shape[3], kv_cache.shape[4])
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    write_rows(flat[0], slot_mapping, k)
    write_v_rows(kv_cache, slot_mapping, v)


class GatherScratch:
    """Two reusable buffers for gathered K and V rows. Layers attend one after another, so one
    pair serves every layer of every step: gathering into fresh tensors allocated (and, on the
    CPU, page-faulted in) the whole batch's K/V twice per layer. The pair keeps the size of the
    largest decode batch's (or verify request's) K/V seen so far."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def get(self, rows: int, cols: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows * cols
        k = self._k
        if k is None or k.numel() < n or k.dtype != like.dtype or k.device != like.device:
            self._k = torch.empty(n, dtype=like.dtype, device=like.device)
            self._v = torch.empty(n, dtype=like.dtype, device=like.device)
        assert self._k is not None and self._v is not None
        return self._k[:n].view(rows, cols), self._v[:n].view(rows, cols)


def gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    scratch: GatherScratch | None = None,
    dtype: torch.dtype | None = None,
):
    """K and V of one or more requests: [..., length, num_kv_heads, head_dim].

    Whole blocks are copied with ``index_select`` over a 2-D view (one contiguous row per
    block), several times faster on the CPU than advanced indexing. With ``scratch`` the rows
    land in its buffers (valid until its next use) instead of new tensors. ``dtype``: the
    token-major V of an FP8 cache is reordered and widened to it in one copy (K and other caches
    are returned in the cache's dtype).
    """
    _, nb, bs, h, d = kv_cache.shape
    nblk = (length + bs - 1) // bs
    blocks = block_table[..., :nblk].long().reshape(-1)
    flat = kv_cache.view(2, nb, bs * h * d)
    shape = (*block_table.shape[:-1], nblk * bs, h, d)
    if scratch is None:
        k = torch.index_select(flat[0], 0, blocks)
        v = torch.index_select(flat[1], 0, blocks)
    else:
        k, v = scratch.get(blocks.numel(), bs * h * d, kv_cache)
        torch.index_select(flat[0], 0, blocks, out=k)
        torch.index_select(flat[1], 0, blocks, out=v)
    if v_token_major(kv_cache.dtype):  # blocks of V are [h, d, page]: to [page, h, d] rows
        rows = torch.empty(v.shape, dtype=dtype or v.dtype, device=v.device)
        rows.view(-1, bs, h, d).copy_(v.view(-1, h, d, bs).permute(0, 3, 1, 2))
        v = rows
    k, v = k.view(shape), v.view(shape)
    return k[..., :length, :, :], v[..., :length, :, :]


def _plan(meta: AttentionMetadata, device: torch.device, window: int | None = None) -> dict:
    """Split the batch into one decode group and per-request prefills (cached on ``meta``, one
    plan per sliding window: the window narrows the masks)."""
    key = "torch_ref" if not window else ("torch_ref", window)
    plan = meta.backend_cache.get(key)
    if plan is not None:
        return plan
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    dec = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
    plan = {"decode": None, "prefill": []}
    if dec:
        max_len = max(seq_lens[i] for i in dec)
        lens = torch.tensor([seq_lens[i] for i in dec], device=device)
        cols = torch.arange(max_len, device=device)[None, :]
        seen = cols < lens[:, None]
        if window:  # the query is at lens - 1
            seen &= cols > lens[:, None] - 1 - window
        plan["decode"] = (
            torch.tensor(dec, device=device),
            torch.tensor([qsl[i] for i in dec], device=device),
            max_len,
            seen[:, None, None, :],  # mask: [B, 1, 1, L], True where the key is seen
        )
    for i in range(meta.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        qlen, length = end - start, seq_lens[i]
        if qlen <= 1:
            continue
        prefix = length - qlen
        mask = None
        if prefix or window:  # row j (position prefix + j) sees keys 0..prefix + j
            mask = torch.ones(qlen, length, dtype=torch.bool, device=device).tril(prefix)
            if window:  # ... and only the last ``window`` of them
                mask &= ~torch.ones_like(mask).tril(prefix - window)
        plan["prefill"].append((i, start, end, length, mask, prefix > 0))
    meta.backend_cache[key] = plan
    return plan


def _sdpa(q, k, v, mask, causal: bool, scale: float, softcap: float | None, gqa: bool = False):
    """SDPA, or with ``softcap`` the same product written out (SDPA has no score hook)."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = _expand(k, g), _expand(v, g)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., Hkv, L, D] → [..., Hkv * groups, L, D] (each KV head serves ``groups`` query heads)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernel_config: KernelConfig | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, kernel_config)
        self._scratch = GatherScratch()  # decode K/V, [B, L, Hkv, D], shared by the layers

    supports_window_softcap = True

    def write_kv(self, k, v, kv_cache, slot_mapping) -> None:
        write_kv(k, v, kv_cache, slot_mapping)

    def _sdpa_gqa(self, q, k, v, mask) -> torch.Tensor:
        """Attention of 4-D ``q`` over gathered K/V rows, the KV heads shared by SDPA's GQA."""
        gqa = self.num_heads > self.num_kv_heads
        k, v = k.to(q.dtype), v.to(q.dtype)
        return _sdpa(q, k, v, mask, False, self.scale, self.logit_softcap, gqa=gqa)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        plan = _plan(meta, q.device, self.sliding_window)
        groups = self.num_heads // self.num_kv_heads
        cap = self.logit_softcap
        if plan["decode"] is not None:
            idx, tok, max_len, mask = plan["decode"]
            kk, vv = gather_kv(kv_cache, meta.block_tables[idx], max_len, self._scratch, q.dtype)
            o = self._sdpa_gqa(q[tok].unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2), mask)
            out[tok] = o.squeeze(2)  # q [B, H, 1, D], K/V [B, Hkv, L, D]
        for i, start, end, length, mask, cached in plan["prefill"]:
            if cached and end - start <= _FEW_QUERIES:  # a verify step's k + 1 tokens
                kk, vv = gather_kv(kv_cache, meta.block_tables[i], length, self._scratch, q.dtype)
                kk, vv = kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0)
                o = self._sdpa_gqa(q[start:end].transpose(0, 1).unsqueeze(0), kk, vv, mask)
                out[start:end] = o[0].transpose(0, 1)  # q [1, H, q, D], K/V [1, Hkv, L, D]
                continue
            if not cached:  # nothing cached before this chunk: its own rows
                kk, vv = k[start:end], v[start:end]
            else:
                kk, vv = gather_kv(kv_cache, meta.block_tables[i], length, dtype=q.dtype)
            # 4-D contiguous inputs with expanded KV heads take SDPA's fast CPU kernel.
            o = _sdpa(
                q[start:end].transpose(0, 1).unsqueeze(0).contiguous(),
                _expand(kk.transpose(0, 1).to(q.dtype), groups).unsqueeze(0).contiguous(),
                _expand(vv.transpose(0, 1).to(q.dtype), groups).unsqueeze(0).contiguous(),
                mask,
                mask is None,
                self.scale,
                cap,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out
