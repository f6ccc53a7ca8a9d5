"""Adapters applied to a step's rows: each targeted linear layer is wrapped so that

    y = base(x);   y[rows of slot s, shard] += scaling_s * (x[rows] @ A_s^T) @ B_s^T

for every adapter slot ``s`` in the step. A fused projection (``qkv_proj``, ``gate_up_proj``)
takes each checkpoint module's update on its own slice of the output, as its weights were
loaded. The wrapper exposes none of the fused fast paths' hooks (``gemv_operands``,
``takes_fp8_rows``), so a wrapped layer always runs as a plain call.

Two ways to run the same update:
- eager steps: the runner tells the shared ``LoRAContext`` which slot each token row uses
  before the forward; rows are grouped by slot, two small matmuls per group, and rows of the
  base model (slot 0) cost nothing;
- CUDA graphs (``graph_mode``, the LoRA decode graphs): shapes are fixed whatever the mix of
  adapters, so every row reads its own adapter's stacked weights through a static slot buffer
  the runner fills before each replay (``kernels/lora.py``: one shrink and one expand launch
  per projection; slot 0's weights are zeros). The base model's graphs hold no LoRA path at all,
  so base-only steps pay nothing for the adapters being loaded.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.kernels.lora import lora_expand, lora_rows_torch, lora_shrink
from fulcrum.lora.adapter import LoRAAdapter

# Checkpoint module names that name no projection an adapter may change here.
_REFUSED = ("embed_tokens", "lm_head")


class LoRAContext:
    """The step's token rows grouped by adapter slot (device index tensors), and the static slot
    buffer of the graph path (``graph_mode``: the forward runs inside a LoRA graph's capture or
    its CPU emulation)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.graph_mode = False
        self.slots = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def set_rows(self, slots: np.ndarray) -> None:
        """``slots[t]``: token row ``t``'s adapter slot (0: the base model)."""
        self.groups = []
        if not slots.any():
            return
        for s in np.unique(slots):
            if s:
                rows = torch.from_numpy(np.flatnonzero(slots == s)).to(self.device)
                self.groups.append((int(s), rows))


class LoRALinear(nn.Module, Configured):
    def __init__(self, base: nn.Module, ctx: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        # while installing: slot -> [(output offset, size, A [r, in], B [size, r], scaling)]
        self.updates: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
        self.a_stack: torch.Tensor | None = None  # [slots + 1, R, in], slot 0 zeros
        self.b_stack: torch.Tensor | None = None  # [slots + 1, out, R], scaling folded in
        self.targeted: frozenset[int] = frozenset()  # the slots that change this layer

    def stack(self, num_slots: int) -> None:
        """Both paths' weights: each slot's updates side by side along the rank (a fused
        projection's shards each fill their own rows of the output), zeros elsewhere; the
        per-module updates are dropped once stacked."""
        a0 = next(iter(self.updates.values()))[0][2]
        n_in, n_out = a0.shape[1], self.base.out_features
        rank = max(sum(u[2].shape[0] for u in ups) for ups in self.updates.values())
        a_stack = a0.new_zeros(num_slots + 1, rank, n_in)
        b_stack = a0.new_zeros(num_slots + 1, n_out, rank)
        for slot, ups in self.updates.items():
            col = 0
            for offset, size, a, b, scaling in ups:
                r = a.shape[0]
                a_stack[slot, col : col + r] = a
                b_stack[slot, offset : offset + size, col : col + r] = b * scaling
                col += r
        self.a_stack, self.b_stack = a_stack, b_stack
        self.targeted, self.updates = frozenset(self.updates), {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        assert self.a_stack is not None and self.b_stack is not None
        if self.ctx.graph_mode:
            x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            slots = self.ctx.slots[: x2.shape[0]]
            if use_triton(x2, self.kernel_config):
                lora_expand(y2, lora_shrink(x2, self.a_stack, slots), self.b_stack, slots)
            else:
                lora_rows_torch(x2, y2, self.a_stack, self.b_stack, slots)
            return y
        if not self.ctx.groups:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows in self.ctx.groups:
            if slot not in self.targeted:
                continue
            delta = (x2.index_select(0, rows) @ self.a_stack[slot].t()) @ self.b_stack[slot].t()
            y2.index_add_(0, rows, delta.to(y2.dtype))
        return y


def install_adapters(
    model: nn.Module,
    adapters: list[LoRAAdapter],
    device: torch.device,
    dtype: torch.dtype,
    max_rows: int,
) -> LoRAContext:
    """Wrap each linear layer an adapter targets (adapter ``i`` is slot ``i + 1``); the
    weights move to ``device`` in ``dtype``. ``max_rows``: the most token rows a graph step
    holds. Raises naming the adapter and module for a target the model does not have or a
    shape it does not match."""
    ctx = LoRAContext(device, max_rows)
    fused = getattr(model, "_FUSED", {})
    for slot, adapter in enumerate(adapters, start=1):
        for module, (a, b) in adapter.weights.items():
            if any(part in module.split(".") for part in _REFUSED):
                raise ValueError(f"lora_modules: adapter {adapter.name!r} changes {module}; "
                                 "only the attention and MLP projections take LoRA here.")  # fmt: skip
            target, offset = module, None
            for frag, (fused_frag, shard) in fused.items():
                if frag in module + ".":
                    target = (module + ".").replace(frag, fused_frag).rstrip(".")
                    offset = model._shard_offsets(fused_frag, shard)
                    break
            try:
                layer = model.get_submodule(target)
            except AttributeError:
                raise ValueError(f"lora_modules: adapter {adapter.name!r} targets {module}, "
                                 "which this model does not have.") from None  # fmt: skip
            wrapper = layer if isinstance(layer, LoRALinear) else None
            base = wrapper.base if wrapper is not None else layer
            n_in, n_out = getattr(base, "in_features", None), getattr(base, "out_features", None)
            if n_in is None or n_out is None:
                raise ValueError(f"lora_modules: adapter {adapter.name!r} targets {module}, "
                                 "which is not a linear layer.")  # fmt: skip
            off, size = offset if offset is not None else (0, n_out)
            if tuple(a.shape) != (adapter.rank, n_in) or tuple(b.shape) != (size, adapter.rank):
                raise ValueError(
                    f"lora_modules: adapter {adapter.name!r}, {module}: A {tuple(a.shape)} and "
                    f"B {tuple(b.shape)} do not fit a [{size}, {n_in}] projection at rank "
                    f"{adapter.rank}."
                )
            if wrapper is None:
                wrapper = LoRALinear(base, ctx)
                parent, _, leaf = target.rpartition(".")
                setattr(model.get_submodule(parent), leaf, wrapper)
            wrapper.updates.setdefault(slot, []).append(
                (off, size, a.to(device, dtype), b.to(device, dtype), adapter.scaling)
            )
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.stack(len(adapters))
            m.kernel_config = getattr(m.base, "kernel_config", m.kernel_config)
    return ctx
