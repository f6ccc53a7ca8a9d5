"""Reference paged attention in plain torch: runs on CPU and CUDA, defines correct behaviour.

Decodes (query_len == 1) are batched into one SDPA call over the gathered blocks; each request
with a longer query (a prefill chunk, or speculative tokens) gets its own causal SDPA call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata, register_backend


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Scatter new K/V rows into the paged cache (slots < 0 are padding and skipped)."""
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, nb * bs, kv_cache.shape[3], kv_cache.shape[4])
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K and V of one or more requests: [..., length, num_kv_heads, head_dim]."""
    bs = kv_cache.shape[2]
    nblk = (length + bs - 1) // bs
    blocks = block_table[..., :nblk].long()
    k = kv_cache[0][blocks]  # [..., nblk, bs, H, D]
    v = kv_cache[1][blocks]
    shape = (*blocks.shape[:-1], nblk * bs, kv_cache.shape[3], kv_cache.shape[4])
    return k.reshape(shape)[..., :length, :, :], v.reshape(shape)[..., :length, :, :]


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decode_rows = [i for i in range(meta.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        gqa = self.num_heads != self.num_kv_heads
        if decode_rows:
            idx = torch.tensor(decode_rows, device=q.device)
            tok = torch.tensor([qsl[i] for i in decode_rows], device=q.device)
            lens = torch.tensor([seq_lens[i] for i in decode_rows], device=q.device)
            max_len = max(seq_lens[i] for i in decode_rows)
            kk, vv = gather_kv(kv_cache, meta.block_tables[idx], max_len)  # [B, L, Hkv, D]
            mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
            qq = q[tok].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                qq,
                kk.transpose(1, 2).to(q.dtype),
                vv.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :],
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[tok] = o.squeeze(2)
        for i in range(meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            qlen = end - start
            if qlen <= 1:
                continue
            length = seq_lens[i]
            kk, vv = gather_kv(kv_cache, meta.block_tables[i], length)  # [L, Hkv, D]
            prefix = length - qlen
            # Row j (position prefix + j) sees keys 0..prefix + j.
            mask = torch.ones(qlen, length, dtype=torch.bool, device=q.device).tril(prefix)
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                kk.transpose(0, 1).to(q.dtype),
                vv.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[start:end] = o.transpose(0, 1)
        return out
