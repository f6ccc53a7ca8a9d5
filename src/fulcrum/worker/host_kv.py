"""The host tier's KV blocks (``host_kv_cache_memory``; the bookkeeping is
``kv_cache/host_tier.py``): one host tensor per layer, laid out as the device pool, and the
step's block copies between the two.

On CUDA the host pool is pinned and every copy is asynchronous on the current stream, so it is
ordered with the step's kernels:

    device -> host   gather the blocks on the device, copy the batch into a pinned buffer; the
                     buffer is scattered into the pool once its copy is done (before anything
                     on the host reads the pool again)
    host -> device   gather the blocks on the host into a pinned buffer, copy it up, scatter
                     into the device pool

Pinned buffers come from torch's caching host allocator, which reuses one only after the copy
that used it has finished.
"""

from __future__ import annotations

import torch


class HostKV:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.cuda = kv_caches[0].is_cuda
        shape = (2, num_blocks, *kv_caches[0].shape[2:])
        # empty, not zeroed: a host block is read only after a copy wrote it
        self.pool = [
            torch.empty(shape, dtype=c.dtype, pin_memory=self.cuda).view(torch.uint8)
            for c in kv_caches
        ]
        # device -> host copies in flight: (done event, per-layer pinned buffers, host blocks)
        self._landing: list[tuple[torch.cuda.Event, list[torch.Tensor], torch.Tensor]] = []

    @property
    def bytes(self) -> int:
        return sum(p.numel() for p in self.pool)

    def apply(self, copies: list[tuple[str, list[int], list[int]]], kv_caches: list[torch.Tensor]) -> None:
        """Make the step's copies, in order, before its forward."""
        dev = [c.view(torch.uint8) for c in kv_caches]
        for kind, src, dst in copies:
            if kind == "d2h":
                self._to_host(dev, src, dst)
            else:
                self._to_device(dev, src, dst)
        self._settle(wait=False)

    def _to_host(self, dev: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        d = torch.tensor(src, dtype=torch.long)
        h = torch.tensor(dst, dtype=torch.long)
        if not self.cuda:
            _copy_blocks(self.pool, h, dev, d)
            return
        self._settle(wait=False)  # (in order: a later copy to the same block lands later)
        d = d.to(dev[0].device, non_blocking=True)
        bufs = []
        for c in dev:
            part = c.index_select(1, d)
            buf = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
            buf.copy_(part, non_blocking=True)
            bufs.append(buf)
        event = torch.cuda.Event()
        event.record()
        self._landing.append((event, bufs, h))

    def _to_device(self, dev: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        self._settle(wait=True)  # the blocks read here may still be on their way down
        h = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        if not self.cuda:
            _copy_blocks(dev, d, self.pool, h)
            return
        d = d.to(dev[0].device, non_blocking=True)
        for p, c in zip(self.pool, dev, strict=True):
            buf = torch.empty((p.shape[0], len(src), *p.shape[2:]), dtype=p.dtype, pin_memory=True)
            torch.index_select(p, 1, h, out=buf)
            c.index_copy_(1, d, buf.to(c.device, non_blocking=True))

    def _settle(self, wait: bool) -> None:
        """Scatter finished device -> host copies into the pool (all of them with ``wait``)."""
        while self._landing:
            event, bufs, h = self._landing[0]
            if not wait and not event.query():
                return
            event.synchronize()
            for p, buf in zip(self.pool, bufs, strict=True):
                p.index_copy_(1, h, buf)
            self._landing.pop(0)


def _copy_blocks(
    dst: list[torch.Tensor], di: torch.Tensor, src: list[torch.Tensor], si: torch.Tensor
) -> None:
    """``dst[layer][:, di] = src[layer][:, si]`` for every layer (the CPU: plain copies)."""
    for d, s in zip(dst, src, strict=True):
        d.index_copy_(1, di, s.index_select(1, si))
