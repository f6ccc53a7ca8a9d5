"""Rotary position embedding over a precomputed cos/sin cache (HF ``rotate_half`` layout).

The default and Llama-3 schemes are computed here (as transformers computes them); the others
(linear, YaRN, ...) come from transformers' own RoPE initialisers, so every scheme matches the
reference implementation exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fulcrum.kernels.dispatch import Configured, use_triton


def _rope_params(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if params["rope_type"] == "su":  # Phi-3's first name for LongRoPE
        params["rope_type"] = "longrope"
    for partial in (
        params.get("partial_rotary_factor"),
        getattr(config, "partial_rotary_factor", None),
    ):
        if partial not in (None, 1.0):
            raise ValueError(f"partial_rotary_factor: {partial} is not supported (1.0 only).")
    return params


def compute_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_params(config)
    rope_type = params["rope_type"]
    if rope_type in ("default", "llama3", "linear"):
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope_type == "linear":  # positions divided by ``factor``
            return inv / params["factor"], 1.0
        return (_llama3_scaled(inv, params) if rope_type == "llama3" else inv), 1.0
    if rope_type == "longrope":
        return _longrope(config, params, head_dim, long=False)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fulcrum.model.loader.hf_config import transformers_config

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}.")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](transformers_config(config), torch.device("cpu"))
    return inv.float(), float(scaling)


def _longrope(config, params: dict, head_dim: int, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): the base frequencies divided by per-dimension ``short_factor`` or
    ``long_factor``, cos/sin scaled by the attention factor (transformers'
    ``_compute_longrope_parameters``)."""
    original = _longrope_original(config, params)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if long else "short_factor"
    if len(params.get(key) or []) != head_dim // 2:
        raise ValueError(
            f"rope_scaling: longrope {key} must list head_dim / 2 = {head_dim // 2} values."
        )
    ext = torch.tensor(params[key], dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * params["rope_theta"] ** shape), float(attention)


def _longrope_original(config, params: dict) -> int:
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if not original:
        raise ValueError("original_max_position_embeddings: longrope scaling needs it.")
    return int(original)


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept,
    a smooth blend between (transformers' ``_compute_llama3_parameters``)."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(Configured, nn.Module):
    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        # Computed on the CPU in float32 (as the reference does), then moved to the device the
        # model is being built on.
        inv_freq, scaling = compute_inv_freq(config, head_dim)
        pos = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq.cpu()[None, :]  # [P, D/2]
        params = _rope_params(config)
        if params["rope_type"] == "longrope":
            # Positions past the pretraining length rotate by the long factors. transformers
            # switches a whole sequence to them once it grows past that length (re-rotating
            # nothing already cached); a paged cache needs a token's rotation to depend on its
            # position alone, so the switch is made per position.
            original = _longrope_original(config, params)
            long_inv, _ = _longrope(config, params, head_dim, long=True)
            freqs[original:] = pos[original:, None] * long_inv[None, :]
        cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)  # [P, D]
        target = torch.empty(0).device  # the active torch.device(...) context, if any
        self.register_buffer("cos_sin_cache", cache.to(target), persistent=False)
        self.head_dim = head_dim

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, Hq, D], ``k`` [T, Hkv, D], ``positions`` [T]."""
        kc = self.kernel_config
        if use_triton(q, kc):
            from fulcrum.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache, pdl_cfg=kc.pdl)
        cos, sin = self._cos_sin(positions, q.dtype)
        half = self.head_dim // 2
        return _rotate(q, cos, sin, half), _rotate(k, cos, sin, half)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows for ``positions``; every layer of a step passes the same tensor, so the
        gather is done once per step."""
        memo = getattr(self, "_memo", None)
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return memo[2], memo[3]
        cs = self.cos_sin_cache[positions]
        half = self.head_dim // 2
        cos = cs[:, None, :half].to(dtype)
        sin = cs[:, None, half:].to(dtype)
        self._memo = (positions, dtype, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (same operations, same rounding as the reference)."""
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1 -= x2 * sin
    torch.mul(x2, cos, out=o2)
    o2 += x1 * sin
    return out
