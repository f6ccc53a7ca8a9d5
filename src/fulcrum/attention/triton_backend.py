"""Paged attention through Triton kernels (CUDA; CPU only through ``TRITON_INTERPRET=1``).

A step runs up to four launches (decode is two: split, then reduce)::

    reshape_and_cache(k, v)            new K/V rows -> paged cache at slot_mapping (fused into
                                       the rotary kernel when the model calls rope_and_write_kv)
    requests with query_len == 1:      decode_attention   split-KV over each context, then reduce
    requests with query_len > 1:       prefill_attention  causal, cached prefix + new chunk

The decode kernel skips the requests that are not its kind on the device (by
``query_start_loc``); the prefill kernel runs over a work list of (request, query block) built
once per step on the host from ``query_start_loc_cpu``. A pure-decode step (``max_query_len == 1``) runs
only the first two, reads only device tensors and the batch shape (``num_reqs``, head counts) --
never sequence lengths on the host -- and reuses one split-KV scratch per device, so it can be
captured in a CUDA graph (run one eager step at the largest batch first).

From ``kernel_config.attention.order_min_reqs`` requests on, the decode kernel takes them longest
context first, so the programs left running at the end of a layer are short ones (measured
faster on an H200 at batches 128 and 384); the order depends on the batch size only, so it is
graph-safe. ``kernel_config.attention.fuse_rope_kv`` fuses rotary with the KV write (one launch
per layer fewer).
"""

from __future__ import annotations

import torch

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata, register_backend
from fulcrum.kernels.decode_attention import DecodeWorkspace, decode_attention
from fulcrum.kernels.prefill_attention import prefill_attention, prefill_block_q, prefill_work
from fulcrum.kernels.reshape_and_cache import reshape_and_cache
from fulcrum.kernels.rotary import apply_rotary

# One scratch per device, shared by every layer: layers run one after another on one stream.
_WORKSPACES: dict[torch.device, DecodeWorkspace] = {}


def _workspace(device: torch.device) -> DecodeWorkspace:
    ws = _WORKSPACES.get(device)
    if ws is None:
        ws = _WORKSPACES[device] = DecodeWorkspace()
    return ws


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    supports_window_softcap = True

    @staticmethod
    def _plan(
        q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[bool, torch.Tensor | None]:
        """(any single-token rows, prefill work list on the device or None), once per step."""
        if meta.is_pure_decode:
            return True, None
        plan = meta.backend_cache.get("triton_plan")
        if plan is None:
            qsl = meta.query_start_loc_cpu
            has_decode = any(qsl[i + 1] - qsl[i] == 1 for i in range(meta.num_reqs))
            items = prefill_work(qsl, meta.seq_lens_cpu, prefill_block_q(q, kv_cache), has_decode)
            work = torch.from_numpy(items)
            if q.is_cuda:
                work = work.pin_memory().to(q.device, non_blocking=True)
            plan = meta.backend_cache["triton_plan"] = (has_decode, work if len(items) else None)
        return plan

    def rope_and_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping, qk_norm=None):
        cos_sin = getattr(rope, "cos_sin_cache", None)
        kc = self.kernel_config
        fuse = cos_sin is not None and kc.attention.fuse_rope_kv
        if fuse and qk_norm is not None:  # plain RMSNorms over whole heads, if switched on
            fuse = (
                kc.attention.fuse_qk_norm
                and qk_norm.rms is not None
                and cos_sin.shape[1] == q.shape[-1]
            )
        if not fuse:
            return super().rope_and_write_kv(
                rope, positions, q, k, v, kv_cache, slot_mapping, qk_norm
            )
        kv_write = (v, kv_cache, slot_mapping)
        norm = qk_norm.rms if qk_norm is not None else None
        return apply_rotary(
            q, k, positions, cos_sin, kv_write=kv_write, pdl_cfg=kc.pdl, qk_norm=norm
        )

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        reshape_and_cache(k, v, kv_cache, slot_mapping, self.kernel_config.pdl)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        kc = self.kernel_config
        n = meta.num_reqs
        views = meta.backend_cache.get("triton_views")  # once per step, not per layer
        if views is None:
            views = (meta.seq_lens[:n], meta.block_tables[:n], meta.query_start_loc[: n + 1])
            meta.backend_cache["triton_views"] = views
        seq_lens, block_tables, query_start_loc = views
        has_decode, work = self._plan(q, kv_cache, meta)
        if has_decode:
            order = None
            if n >= kc.attention.order_min_reqs:  # one sort per step, shared by the layers
                order = meta.backend_cache.get("decode_order")
                if order is None:
                    order = torch.argsort(seq_lens, descending=True)
                    meta.backend_cache["decode_order"] = order
            decode_attention(
                q,
                kv_cache,
                block_tables,
                seq_lens,
                self.scale,
                query_start_loc=query_start_loc,
                out=out,
                workspace=_workspace(q.device),
                order=order,
                cfg=kc.attention,
                pdl_cfg=kc.pdl,
                window=self.sliding_window,
                softcap=self.logit_softcap,
            )
        if work is not None:
            prefill_attention(
                q,
                kv_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                meta.max_query_len,
                self.scale,
                out=out,
                skip_decode=has_decode,
                work=work,
                pdl_cfg=kc.pdl,
                window=self.sliding_window,
                softcap=self.logit_softcap,
            )
        return out
