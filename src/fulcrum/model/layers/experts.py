"""The routed experts of a mixture-of-experts layer, stacked for the grouped GEMMs.

Every expert's gate and up projections are stacked as ``w13 [E, 2I, H]`` (gate rows first) and
its down projection as ``w2 [E, H, I]``: the layout ``kernels/fused_moe.py`` reads. With FP8
experts both hold float8 e4m3 rows with one fp32 scale per row (``w13_scale [E, 2I]``,
``w2_scale [E, H]``), quantized as the checkpoint's rows load (as ``quant/fp8.py`` does for a
linear layer).

Which path runs: the fused Triton kernels on CUDA (``KernelConfig.fused_moe``), else the
per-expert torch loop -- the reference, exact on the CPU. The loop asks the host which experts
were picked, which a CUDA graph cannot hold, so a capture without the fused kernels runs every
expert on every row instead (masked by the routing weights; slow, but the same result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.kv_cache.dtype import FP8_DTYPE
from fulcrum.model.layers.moe_ref import expert_weights, fused_moe_ref

_GATE, _UP, _DOWN = "gate", "up", "down"


def routed_fast(x: torch.Tensor, kc) -> bool:
    """Whether ``x``'s layer takes the fused Triton routing and experts."""
    return kc.fused_moe and use_triton(x, kc)


class Experts(Configured, nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, fp8: bool = False) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.fp8 = num_experts, hidden, inter, fp8
        dtype = FP8_DTYPE if fp8 else None
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False
        )
        if fp8:  # not checkpoint tensors: computed as the rows load
            ones = torch.ones
            self.register_buffer("w13_scale", ones(num_experts, 2 * inter), persistent=False)
            self.register_buffer("w2_scale", ones(num_experts, hidden), persistent=False)
        else:
            self.w13_scale = self.w2_scale = None

    def _rows(self, expert: int, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight rows (and their scales) that checkpoint tensor ``part`` of ``expert``
        fills."""
        if part == _DOWN:
            return self.w2.data[expert], None if self.w2_scale is None else self.w2_scale[expert]
        start = 0 if part == _GATE else self.inter
        rows = self.w13.data[expert].narrow(0, start, self.inter)
        scale = None if self.w13_scale is None else self.w13_scale[expert, start:]
        return rows, None if scale is None else scale[: self.inter]

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor, name: str) -> None:
        """Copy (quantize, for FP8) checkpoint tensor ``name`` -- ``part`` gate, up or down of
        ``expert`` -- into its rows."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"model weights: tensor {name!r} names expert {expert}; the config has "
                f"{self.num_experts}."
            )
        dst, scale = self._rows(expert, part)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"model weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}."
            )
        if scale is None:
            dst.copy_(tensor)
            return
        from fulcrum.quant.fp8 import quantize_rows

        q, s = quantize_rows(tensor.to(dst.device))
        dst.copy_(q)
        scale.copy_(s)

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random rows in [-0.02, 0.02] (the loader's dummy init), quantized expert by expert
        for FP8, so the experts never exist in full precision at once."""
        if not self.fp8:
            for p in (self.w13, self.w2):
                p.data.uniform_(-0.02, 0.02, generator=generator)
            return
        from fulcrum.quant.fp8 import quantize_rows

        dev = self.w13.device
        for e in range(self.num_experts):
            for w, scale in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)):
                rows = torch.empty(w.shape[1:], device=dev).uniform_(
                    -0.02, 0.02, generator=generator
                )
                q, s = quantize_rows(rows)
                w.data[e].copy_(q)
                scale[e].copy_(s)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, each token's routing ``weights`` and expert ``ids`` ``[T, k]`` ->
        ``[T, H]``."""
        args = (x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale)
        if routed_fast(x, self.kernel_config):
            from fulcrum.kernels.fused_moe import fused_moe

            return fused_moe(*args, act_fp8_rows=self.kernel_config.moe_fp8_act_rows)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return _every_expert(*args)
        return fused_moe_ref(*args)


def _every_expert(x, w13, w2, weights, ids, w13_scale, w2_scale) -> torch.Tensor:
    """The per-expert loop without host syncs: each expert on every row, weighted by the
    routing weight it got (zero where not picked)."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        a, b = expert_weights(w13, w2, w13_scale, w2_scale, e, x.dtype)
        gate, up = F.linear(x, a).chunk(2, dim=-1)
        w = (weights * (ids == e)).sum(-1, keepdim=True).to(x.dtype)
        out += F.linear(F.silu(gate) * up, b) * w
    return out
