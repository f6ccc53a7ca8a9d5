"""The host tier's KV blocks (``host_kv_cache_memory``; the bookkeeping is
``kv_cache/host_tier.py``) and the step's block copies between it and the device pool.

The host pool is block-major, one contiguous run per block holding every layer's K and V
(pinned on CUDA), so a block crosses the bus as one copy and the host's CPU never touches the
data::

    device -> host   per layer, gather the blocks into a device staging buffer
                     [n, layers, 2, page, heads, D]; then one asynchronous copy per block
                     from the staging buffer into its host run
    host -> device   one asynchronous copy per block from its host run into the staging
                     buffer; then per layer, scatter into the device pool

Every copy is queued on the current stream, so it is ordered with the step's kernels: a
block leaves the device before its next owner writes it, arrives before a request reads it,
and a host run is rewritten only after the copies that read it.
"""

from __future__ import annotations

import torch


class HostKV:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        first = kv_caches[0]
        self.layers = len(kv_caches)
        self.block_shape = (2, *first.shape[2:])  # one layer's K and V of one block
        cuda = first.is_cuda
        # empty, not zeroed: a host block is read only after a copy wrote it
        self.pool = torch.empty(
            (num_blocks, self.layers, *self.block_shape), dtype=first.dtype, pin_memory=cuda
        ).view(torch.uint8)

    def apply(self, copies: list[tuple[str, list[int], list[int]]], kv_caches: list[torch.Tensor]) -> None:
        """Make the step's copies, in order, before its forward."""
        dev = [c.view(torch.uint8) for c in kv_caches]
        for kind, src, dst in copies:
            if kind == "d2h":
                self._to_host(dev, src, dst)
            else:
                self._to_device(dev, src, dst)

    def _staging(self, dev: list[torch.Tensor], n: int) -> torch.Tensor:
        return torch.empty((n, self.layers, *self.pool.shape[2:]), dtype=torch.uint8,
                           device=dev[0].device)  # fmt: skip

    def _to_host(self, dev: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        d = torch.tensor(src, dtype=torch.long).to(dev[0].device, non_blocking=True)
        stage = self._staging(dev, len(src))
        for layer, c in enumerate(dev):
            stage[:, layer] = c.index_select(1, d).transpose(0, 1)
        for j, h in enumerate(dst):
            self.pool[h].copy_(stage[j], non_blocking=True)

    def _to_device(self, dev: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        stage = self._staging(dev, len(src))
        for j, h in enumerate(src):
            stage[j].copy_(self.pool[h], non_blocking=True)
        d = torch.tensor(dst, dtype=torch.long).to(dev[0].device, non_blocking=True)
        for layer, c in enumerate(dev):
            c.index_copy_(1, d, stage[:, layer].transpose(0, 1))
