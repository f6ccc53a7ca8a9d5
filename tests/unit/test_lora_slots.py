"""The adapter registry (slots by name, load generations) and the LoRA layer's fast-path hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fulcrum.config import LoRAConfig
from fulcrum.lora.layers import LoRAContext, LoRALinear
from fulcrum.lora.registry import LoRARegistry


def test_registry_slots_names_and_generations() -> None:
    reg = LoRARegistry(LoRAConfig(adapters=(("a", "/a"),), max_loras=2, runtime_updates=True))
    assert reg.slot("a") == 1 and reg.adapters() == {"a": "/a"}
    first = reg.cache_salt("a")
    held: set[int] = set()
    assert reg.free_slot("b", held.__contains__) == 2
    reg.assign(2, "b", "/b")
    with pytest.raises(ValueError, match="max_loras: all 2 adapter slots are in use"):
        reg.free_slot("c", held.__contains__)
    with pytest.raises(ValueError, match="lora_name: an adapter named 'b' is loaded already"):
        reg.free_slot("b", held.__contains__)
    assert reg.remove("a") == 1
    with pytest.raises(ValueError, match="lora: no adapter named 'a' \\(served: b\\)"):
        reg.slot("a")
    held.add(1)  # a request still runs the unloaded adapter
    with pytest.raises(ValueError, match="max_loras"):
        reg.free_slot("a", held.__contains__)
    held.clear()
    assert reg.free_slot("a", held.__contains__) == 1
    reg.assign(1, "a", "/a2")
    assert reg.cache_salt("a") != first  # loaded again: other weights, other cache entries


def test_config_slots_and_rank_cap() -> None:
    assert LoRAConfig().num_slots == 0 and not LoRAConfig().enabled
    assert LoRAConfig(runtime_updates=True).num_slots == 1
    assert LoRAConfig(adapters=(("a", "/a"), ("b", "/b"))).num_slots == 2
    assert LoRAConfig(runtime_updates=True).rank_cap([8]) == 16
    assert LoRAConfig().rank_cap([8, 32]) == 32
    assert LoRAConfig(max_lora_rank=64).rank_cap([8]) == 64
    with pytest.raises(ValueError, match="max_loras: 1 slots cannot hold the 2 lora_modules"):
        LoRAConfig(adapters=(("a", "/a"), ("b", "/b")), max_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 0"):
        LoRAConfig(max_lora_rank=-1)


class _Fused(nn.Linear):
    def gemv_operands(self):  # noqa: ANN202 - stands for a layer the one-row GEMV takes
        return self.weight, self.bias, None


def test_fast_path_hooks_show_only_without_adapter_rows() -> None:
    """A fused kernel may run the base projection in the wrapper's place only when no row of
    the forward runs an adapter (it would skip the adapter's update)."""
    ctx = LoRAContext(torch.device("cpu"), 4, torch.float32)
    layer = LoRALinear(_Fused(8, 6), ctx, num_slots=1, rank_cap=2, shards=1)
    assert layer.gemv_operands()[0] is layer.base.weight
    assert getattr(layer, "takes_fp8_rows", None) is None  # the base has none
    ctx.groups = [(1, torch.tensor([0]))]
    assert getattr(layer, "gemv_operands", None) is None
    ctx.groups, ctx.graph_mode = [], True
    assert getattr(layer, "gemv_operands", None) is None
