"""Adapters applied to a step's rows: each targeted linear layer is wrapped so that

    y = base(x);   y[rows of slot s, shard] += scaling_s * (x[rows] @ A_s^T) @ B_s^T

for every adapter slot ``s`` in the step. A fused projection (``qkv_proj``, ``gate_up_proj``)
takes each checkpoint module's update on its own slice of the output, as its weights were
loaded. The base layer's fused fast paths' hooks (``gemv_operands``, ``takes_fp8_rows``: a
norm, activation or rotary fused into the projection's kernel) show through the wrapper only
while the forward has no adapter rows, so base-model steps (and the base graphs) keep them.

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

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fulcrum.config import LoRAConfig
from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.kernels.lora import lora_expand, lora_rows_torch, lora_shrink
from fulcrum.lora.adapter import LoRAAdapter

# The base layer's hooks that let a fused kernel run the projection instead of its forward.
_FAST_PATH_HOOKS = (
    "gemv_operands", "takes_fp8_rows", "forward_fp8", "takes_one_row", "one_row_epilogue"
)

# Checkpoint module names that name no projection an adapter may change here.
_REFUSED = ("embed_tokens", "lm_head")


class LoRAContext:
    """The step's token rows grouped by adapter slot (device index tensors), and the static slot
    buffer of the graph path (``graph_mode``: the forward runs inside a LoRA graph's capture or
    its CPU emulation)."""

    def __init__(self, device: torch.device, max_rows: int, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype  # the adapters' weights
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
    """A targeted projection with every slot's adapter weights stacked beside it.

    The rank axis has one block of ``rank_cap`` columns per checkpoint module fused into this
    projection (``qkv_proj``: q, k, v), so any adapter's module lands at a fixed place and a
    slot can be rewritten in place while serving: the tensors the CUDA graphs read never move.
    A module an adapter does not change keeps zeros."""

    def __init__(
        self, base: nn.Module, ctx: LoRAContext, num_slots: int, rank_cap: int, shards: int
    ) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        self.rank_cap = rank_cap
        n_in, n_out, dev, dtype = base.in_features, base.out_features, ctx.device, ctx.dtype
        self.a_stack = torch.zeros(num_slots + 1, shards * rank_cap, n_in, dtype=dtype, device=dev)
        self.b_stack = torch.zeros(num_slots + 1, n_out, shards * rank_cap, dtype=dtype, device=dev)
        self.targeted: set[int] = set()  # the slots that change this layer

    def __getattr__(self, name: str):  # noqa: ANN204 - nn.Module's own lookup first
        if name in _FAST_PATH_HOOKS:
            ctx = self.__dict__["ctx"]
            if ctx.graph_mode or ctx.groups:  # adapter rows: the plain call adds their update
                raise AttributeError(name)
            return getattr(self.base, name)
        return super().__getattr__(name)

    def clear(self, slot: int) -> None:
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        self.targeted.discard(slot)

    def put(self, slot: int, shard: int, offset: int, a: torch.Tensor, b: torch.Tensor,
            scaling: float) -> None:  # fmt: skip
        """One checkpoint module's update: ``A [r, in]`` and ``B [size, r]`` (scaling folded in)
        onto output rows ``offset : offset + size``."""
        r, col = a.shape[0], shard * self.rank_cap
        self.a_stack[slot, col : col + r] = a
        self.b_stack[slot, offset : offset + b.shape[0], col : col + r] = b * scaling
        self.targeted.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
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


# The projections a runtime-loaded adapter may change: fused names and their own.
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # fmt: skip


class LoRASlots:
    """The model's LoRA layers and what each adapter slot holds; ``load`` and ``clear`` write
    a slot in place (stream-ordered after any step already launched that reads it)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, startup: list[LoRAAdapter],
                 device: torch.device, dtype: torch.dtype, max_rows: int,
                 shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        """``shard``: this tensor-parallel rank's slice of a checkpoint tensor by name
        (``ShardSpec``; None: one rank)."""
        self.model = model
        self.shard = shard
        self.ctx = LoRAContext(device, max_rows, dtype)
        self.rank_cap = config.rank_cap([a.rank for a in startup])
        self.num_slots = config.num_slots
        self._fused: dict[str, tuple[str, int]] = getattr(model, "_FUSED", {})
        if config.runtime_updates:  # any projection of any layer, for adapters not known yet
            targets = {
                n for n, m in model.named_modules()
                if n.rsplit(".", 1)[-1] in _PROJECTIONS and hasattr(m, "in_features")
            }  # fmt: skip
        else:  # only what the startup adapters change
            targets = {self._locate(a, module)[0] for a in startup for module in a.weights}
        self.layers: dict[str, LoRALinear] = {}
        for target in sorted(targets):
            base = model.get_submodule(target)
            frag = "." + target.rsplit(".", 1)[-1] + "."
            shards = sum(1 for fused, _ in self._fused.values() if fused == frag) or 1
            layer = LoRALinear(base, self.ctx, self.num_slots, self.rank_cap, shards)
            layer.kernel_config = getattr(base, "kernel_config", layer.kernel_config)
            # a row-parallel projection's all-reduce (a forward hook) sums the adapter's partial
            # update too: each rank's input columns of A times the whole B
            layer._forward_hooks.update(base._forward_hooks)
            base._forward_hooks.clear()
            parent, _, leaf = target.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)
            self.layers[target] = layer
        for slot, adapter in enumerate(startup, start=1):
            self.load(slot, adapter)

    def _locate(self, adapter: LoRAAdapter, module: str) -> tuple[str, int, tuple[int, int] | None]:
        """``(target, shard, (offset, size) or None)`` of a checkpoint module; ValueError
        naming the adapter and module where it is no projection of this model."""
        if any(part in module.split(".") for part in _REFUSED):
            raise ValueError(f"lora_modules: adapter {adapter.name!r} changes {module}; "
                             "only the attention and MLP projections take LoRA here.")  # fmt: skip
        for frag, (fused, shard) in self._fused.items():
            if frag in module + ".":
                target = (module + ".").replace(frag, fused).rstrip(".")
                return target, shard, self.model._shard_offsets(fused, shard)
        return module, 0, None

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot``; every module is checked before the slot changes.
        ValueError naming the adapter and the module (or ``max_lora_rank``) otherwise."""
        if adapter.rank > self.rank_cap:
            raise ValueError(f"max_lora_rank: adapter {adapter.name!r} has rank {adapter.rank}; "
                             f"the adapter slots hold rank {self.rank_cap} at most.")  # fmt: skip
        plan = []
        for module, (a, b) in adapter.weights.items():
            target, shard, offset = self._locate(adapter, module)
            if self.shard is not None:  # A's input columns (row-parallel), else B's output rows
                name = module + ".weight"
                row_parallel = name.endswith((".o_proj.weight", ".down_proj.weight"))
                a, b = (self.shard(name, a), b) if row_parallel else (a, self.shard(name, b))
            layer = self.layers.get(target)
            if layer is None:
                try:
                    self.model.get_submodule(target)
                    what = "which takes no LoRA here"
                except AttributeError:
                    what = "which this model does not have"
                raise ValueError(f"lora_modules: adapter {adapter.name!r} targets {module}, {what}.")
            off, size = offset if offset is not None else (0, layer.base.out_features)
            n_in = layer.base.in_features
            if tuple(a.shape) != (adapter.rank, n_in) or tuple(b.shape) != (size, adapter.rank):
                raise ValueError(
                    f"lora_modules: adapter {adapter.name!r}, {module}: A {tuple(a.shape)} and "
                    f"B {tuple(b.shape)} do not fit a [{size}, {n_in}] projection at rank "
                    f"{adapter.rank}."
                )
            plan.append((layer, shard, off, a, b))
        self.clear(slot)
        for layer, shard, off, a, b in plan:
            dev = layer.a_stack
            layer.put(slot, shard, off, a.to(dev.device, dev.dtype), b.to(dev.device, dev.dtype),
                      adapter.scaling)  # fmt: skip

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
