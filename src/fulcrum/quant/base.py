"""How a quantization method plugs into the model: it builds the linear layers.

A method returns, for each projection of a decoder layer (qkv, o, gate_up, down), a module that
behaves like ``nn.Linear`` -- ``forward(x [T, in]) -> [T, out]`` in the activations' dtype -- and
owns whatever tensors its format needs. Checkpoints hold full-precision rows; the model's loader
hands each checkpoint tensor (or a fused shard's rows) to the module's ``weight_loader``, which
quantizes as it copies, so a model never exists in full precision on the device. Embeddings,
norms and the LM head stay in the model's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class QuantMethod(ABC):
    name: str = "abstract"

    @classmethod
    def from_quant_config(cls, quant_config: dict[str, Any] | None) -> QuantMethod:
        """The method for a checkpoint whose ``config.json`` has this ``quantization_config``
        (None: none given; methods that quantize at load need none)."""
        return cls()

    @abstractmethod
    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A linear layer in this format, allocated on the current default device."""

    @abstractmethod
    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` if this method cannot run on ``device``."""


QUANT_METHODS: dict[str, type[QuantMethod]] = {}


def register_quant_method(name: str):
    def deco(cls: type[QuantMethod]) -> type[QuantMethod]:
        cls.name = name
        QUANT_METHODS[name] = cls
        return cls

    return deco
