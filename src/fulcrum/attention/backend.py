"""Attention backend interface and the per-step metadata every backend reads.

A step's batch is *flattened*: the new tokens of all scheduled requests are concatenated into one
run of ``num_tokens``. Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
its context after this step is ``seq_lens[i]`` tokens, of which the last ``query_len`` are new::

    request i:  [ cached prefix (seq_len - query_len) | new tokens (query_len) ]
                  ^ already in the paged KV cache        ^ written to the cache this step

A new token at position ``p`` (0-based in its sequence) attends to positions ``0..p`` (causal).

KV cache layout, one tensor per layer::

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

Token ``p`` of request ``i`` lives in block ``block_tables[i, p // block_size]`` at offset
``p % block_size``; ``slot_mapping[t] = block * block_size + offset`` for each new token ``t``
(``-1`` marks a padding token that must not be written).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from fulcrum.config import KernelConfig


class QKNorm(NamedTuple):
    """Norms over each head of q and of k, applied before rotary (Qwen3). ``rms``: ``(q weight,
    k weight, eps)`` where both are plain RMSNorms (``kernels/rmsnorm.py``'s numerics) that a
    backend may fuse into its rotary kernel; None where they are not."""

    q: nn.Module
    k: nn.Module
    rms: tuple[torch.Tensor, torch.Tensor, float] | None


@dataclass
class AttentionMetadata:
    num_tokens: int  # new tokens in this step, over all requests
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_reqs] int32, on device: context length incl. new tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device (pad: 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, on device
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that split work on the CPU (the torch reference).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step scratch a backend may fill on the first layer and reuse on the others.
    backend_cache: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc_cpu: list[int],
        seq_lens_cpu: list[int],
        max_query_len: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        """The one way a step's metadata is made (eager steps, decode and piecewise graphs, the
        start-up passes): the token and request counts are read off the host query starts, so
        they cannot disagree with them. ``slot_mapping`` may be longer than ``num_tokens`` (a
        graph bucket's padding rows, slot -1); a captured graph passes placeholder host lists
        and the largest ``max_seq_len`` it serves, since its kernels read only device tensors."""
        return cls(
            num_tokens=query_start_loc_cpu[-1],
            num_reqs=len(seq_lens_cpu),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes paged attention for one layer.

    Implementations: ``torch_ref.TorchAttentionBackend`` (CPU and CUDA, the reference) and
    ``triton_backend.TritonAttentionBackend`` (CUDA; CPU through ``TRITON_INTERPRET=1``).
    """

    name: str = "abstract"
    # Per-layer variants (Gemma 2/3), set on a layer's copy by ``for_layer``: a query at
    # position p sees keys p - window < j <= p; scores s become cap * tanh(s / cap).
    sliding_window: int | None = None
    logit_softcap: float | None = None
    supports_window_softcap: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernel_config: KernelConfig | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # the engine's kernel switches (the model replaces it with its own at construction)
        self.kernel_config = kernel_config if kernel_config is not None else KernelConfig()

    def for_layer(
        self, scale: float, sliding_window: int | None, logit_softcap: float | None
    ) -> AttentionBackend:
        """A copy for one layer with its own scale, window and soft-cap (sharing this
        backend's scratch). A backend whose kernels do not apply a window or a cap refuses
        them, naming the field, rather than attend without them."""
        if sliding_window and not self.supports_window_softcap:
            raise ValueError(
                f"sliding_window: the {self.name!r} attention backend does not apply sliding "
                "windows yet; use attention_backend='torch'."
            )
        if logit_softcap and not self.supports_window_softcap:
            raise ValueError(
                f"attn_logit_softcapping: the {self.name!r} attention backend does not "
                "soft-cap scores yet; use attention_backend='torch'."
            )
        b = copy.copy(self)
        b.scale, b.sliding_window, b.logit_softcap = scale, sliding_window, logit_softcap
        return b

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new ``k``/``v`` into ``kv_cache`` at ``meta.slot_mapping``, then attend each
        new query to its request's whole context (cached prefix plus new tokens), causally."""
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, k, v, kv_cache, meta)

    def rope_and_write_kv(
        self,
        rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        qk_norm: QKNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on ``q``/``k`` (``rope(positions, q, k)``), then :meth:`write_kv` of the
        rotated ``k`` and ``v``; returns the rotated ``(q, k)``. ``qk_norm``: the norms of each
        head of q and of k (Qwen3) applied before rotary. A backend may fuse all of it."""
        if qk_norm is not None:
            q, k = qk_norm.q(q.contiguous()), qk_norm.k(k.contiguous())
        q, k = rope(positions, q, k)
        self.write_kv(k, v, kv_cache, slot_mapping)
        return q, k

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The new ``k``/``v`` rows into ``kv_cache`` at ``slot_mapping`` (``-1``: padding, not
        written). Depends on the token count only, so a CUDA graph may hold it."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``forward`` after ``write_kv``: the cache already holds this step's rows (``k``/``v``
        are there for a backend that reads a chunk's own rows directly)."""


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(name: str):
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        ATTENTION_BACKENDS[name] = cls
        return cls

    return deco
