"""Pinned host buffers that a step's inputs are copied through to the device.

Every step stages its host arrays (ids, positions, KV slots, block tables, query starts) in
named buffers that live as long as the runner: pinned on CUDA, so a copy out of them is
asynchronous and the host goes on building the step while the device reads them.
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor the device can copy from asynchronously (plain memory without CUDA)."""
    t = torch.empty(shape, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


class HostStaging:
    """Named host buffers that grow on demand (pinned on CUDA, so copies are asynchronous).

    Reused every step: ``fence`` records an event after a step's copies are queued and ``wait``
    (at the next step's start) blocks until they are done -- normally long since, because a step
    that samples already waited for its ids; a prefill-chunk step samples nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def fence(self) -> None:
        if self._event is not None:
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = pinned(
                (max(numel, 2 * (buf.numel() if buf is not None else 0), 64),), dtype, self.device
            )
            self._bufs[name] = buf
        return buf[:numel]

    def put(
        self, name: str, values: np.ndarray, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``values`` → device, through this buffer (non-blocking): a new tensor, or ``out``."""
        host = self.get(name, values.size, dtype)
        host.numpy()[...] = values.reshape(-1)
        if out is None:
            return host.view(values.shape).to(self.device, non_blocking=True)
        return out.copy_(host.view(values.shape), non_blocking=True)
