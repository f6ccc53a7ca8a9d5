"""Rotary position embedding over a precomputed cos/sin cache (HF ``rotate_half`` layout).

Frequencies come from transformers' own RoPE initialisers, so Llama-3, linear, dynamic-free YaRN
and the default scheme all match the reference implementation exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.model.layers.dispatch import use_triton


def _rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def compute_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_params(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}.")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(config, head_dim)
        pos = torch.arange(max_position, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)  # [P, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, Hq, D], ``k`` [T, Hkv, D], ``positions`` [T]."""
        if use_triton(q):
            from fulcrum.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache)
        cs = self.cos_sin_cache[positions]
        half = self.head_dim // 2
        cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :].to(q.dtype)
        sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :].to(q.dtype)
        return _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
