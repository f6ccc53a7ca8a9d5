"""A PEFT LoRA adapter read from its directory: ``adapter_config.json`` and
``adapter_model.safetensors`` (``<module>.lora_A.weight`` ``[r, in]``, ``<module>.lora_B.weight``
``[out, r]``). A module's update is ``scaling * B @ A``, ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). What this engine does not apply is refused by name, never ignored."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    # checkpoint module name (``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"lora_modules: adapter {name!r}: {what}")


def load_adapter(name: str, path: str) -> LoRAAdapter:
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {cfg.get('peft_type')!r} is not LORA.")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise _refuse(name, f"{key}={bad} is not supported.")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise _refuse(name, f"{key} is not supported (set in adapter_config.json).")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, f"bias={cfg['bias']!r} is not supported (only 'none').")
    rank = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise _refuse(name, f"no adapter_model.safetensors in {path} (save it with "
                            "safe_serialization=True).")  # fmt: skip
    from safetensors.torch import load_file

    tensors = load_file(file)
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        module, _, leaf = key.removeprefix(_PREFIX).rpartition(".lora_")
        kind = leaf.split(".")[0]  # "A.weight" or "A.default.weight"
        if not module or kind not in ("A", "B") or not leaf.endswith("weight"):
            raise _refuse(name, f"tensor {key!r} is not a LoRA A or B weight.")
        (a if kind == "A" else b)[module] = t
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))[0]
        raise _refuse(name, f"module {odd!r} has only one of lora_A and lora_B.")
    weights = {}
    for module in a:
        if a[module].shape[0] != rank or b[module].shape[1] != rank:
            raise _refuse(name, f"{module}: A {tuple(a[module].shape)} and B "
                                f"{tuple(b[module].shape)} do not have rank r={rank}.")  # fmt: skip
        weights[module] = (a[module], b[module])
    return LoRAAdapter(name, rank, scaling, weights)
