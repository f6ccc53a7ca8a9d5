"""FP8 weights and activations (W8A8, float8 e4m3), the format of vLLM's ``--quantization fp8``.

A weight ``W [out, in]`` is stored as e4m3 with one fp32 scale per output row (the checkpoint's
full-precision rows are quantized as they load: ``w_scale[r] = max|W[r]| / 448``). At run time
each token's activations are quantized with a scale of their own
(``kernels/quant_fp8.py``), and one ``torch._scaled_mm`` multiplies the two FP8 operands with
FP8 tensor cores and applies both scales on the way out::

    y[t, r] = (sum_k q_x[t, k] * q_w[r, k]) * x_scale[t] * w_scale[r]   (+ bias[r])

Half the weight bytes of bf16 -- what a bandwidth-bound decode step reads -- and twice the
tensor-core rate of bf16 on Hopper. Needs a GPU with FP8 tensor cores (compute capability 8.9
or later) or the CPU, where the same product is computed in fp32 from the FP8 operands widened
on the fly (the weights stay FP8 in memory; slow, for tests and small models).

A one-row call on CUDA (a batch-1 decode step) runs the Triton GEMV instead
(``kernels/gemv.py``: the e4m3 rows widened in registers, the row scale applied to the sum, the
activations not quantized): an FP8 GEMM pads the row to a tensor-core tile and needs a
quantization launch, where the GEMV only streams the weight (measured faster for an 8B model's
batch-1 step on an H200).
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.kernels import GEMV_MAX_M
from fulcrum.kernels.dispatch import Configured, use_triton
from fulcrum.kernels.quant_fp8 import FP8, per_token_quant_fp8_ref
from fulcrum.quant.base import QuantMethod, register_quant_method


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [n, in]`` (any float dtype) -> ``(e4m3 [n, in], fp32 scale [n])``, one scale per row
    (the activations' per-token rule, applied to weight rows)."""
    q, s = per_token_quant_fp8_ref(w)
    return q, s[:, 0]


class Fp8Linear(Configured, nn.Module):
    """``nn.Linear`` with an e4m3 weight and per-row scales; activations quantized per token."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        # [1, out] contiguous: the layout _scaled_mm takes; not a checkpoint tensor.
        self.register_buffer(
            "weight_scale", torch.ones(1, out_features, dtype=torch.float32), persistent=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(self, tensor: torch.Tensor, offset: int = 0) -> None:
        """Quantize full-precision checkpoint rows into rows ``offset:offset + len(tensor)``."""
        n = tensor.shape[0]
        if tuple(tensor.shape) != (n, self.in_features) or offset + n > self.out_features:
            raise ValueError(
                f"model weights: rows of shape {tuple(tensor.shape)} at row {offset} do not fit "
                f"a [{self.out_features}, {self.in_features}] FP8 weight."
            )
        q, s = quantize_rows(tensor.to(self.weight.device))
        self.weight.data[offset : offset + n].copy_(q)
        self.weight_scale[0, offset : offset + n] = s

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator, chunk_rows: int = 4096) -> None:
        """Random rows in [-0.02, 0.02], quantized chunk by chunk on the weight's device."""
        for r in range(0, self.out_features, chunk_rows):
            n = min(chunk_rows, self.out_features - r)
            rows = torch.empty(n, self.in_features, device=self.weight.device)
            self.weight_loader(rows.uniform_(-0.02, 0.02, generator=generator), r)
        if self.bias is not None:
            self.bias.data.uniform_(-0.02, 0.02, generator=generator)

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias, per-row scale) as the GEMV takes them (``norm_linear``)."""
        return self.weight, self.bias, self.weight_scale.view(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        kc = self.kernel_config
        if use_triton(x2, kc):
            from fulcrum.kernels import gemv
            from fulcrum.kernels.quant_fp8 import per_token_quant_fp8

            if x2.shape[0] <= GEMV_MAX_M and gemv.use_gemv(x2, self.weight, kc.gemv.max_m):
                scale = self.weight_scale.view(-1)
                y = gemv.gemv(
                    x2, self.weight, self.bias, scale=scale, pdl_cfg=kc.pdl,
                    launch=kc.gemv.launch, fp8_words=kc.gemv.fp8_words,
                )
                return y.view(*x.shape[:-1], self.out_features)
            q, s = per_token_quant_fp8(x2, kc.pdl)
        else:
            q, s = per_token_quant_fp8_ref(x2)
            if not x2.is_cuda:
                y = self._dequantized_mm(q, s).to(x.dtype)
                return self._add_bias(y).view(*x.shape[:-1], self.out_features)
        return self.forward_fp8(q, s, x.dtype).view(*x.shape[:-1], self.out_features)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x [T, *]``'s rows would be quantized per token for the GEMM on CUDA (not
        the few-row GEMV): then the kernel before may hand them over quantized
        (``forward_fp8``; ``kernel_config.fuse_fp8_quant``)."""
        return x.shape[0] > GEMV_MAX_M and x.dim() == 2 and use_triton(x, self.kernel_config)

    def forward_fp8(self, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer on rows already quantized per token (``q`` e4m3 ``[T, in]``, ``s`` fp32
        ``[T, 1]``): ``[T, out]`` in ``dtype``."""
        # Row-wise scales on CUDA come out in bf16 only with some backends (CUTLASS).
        out_dtype = torch.bfloat16 if q.is_cuda else dtype
        y = torch._scaled_mm(
            q, self.weight.t(), scale_a=s, scale_b=self.weight_scale, out_dtype=out_dtype
        ).to(dtype)
        return self._add_bias(y)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        # Added apart: not every backend takes a bias with row scales.
        return y if self.bias is None else y + self.bias

    def _dequantized_mm(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The same product as ``_scaled_mm``, in fp32 on widened copies of the FP8 operands:
        CPU builds of torch differ in what ``_scaled_mm`` takes (some only per-tensor scales),
        and the weight stays FP8 in memory (only this call's fp32 copy is transient)."""
        return (q.float() @ self.weight.float().t()) * s * self.weight_scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


@register_quant_method("fp8")
class Fp8Method(QuantMethod):
    def linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return Fp8Linear(in_features, out_features, bias)

    def check_device(self, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"quantization: fp8 needs FP8 tensor cores (compute capability 8.9 or later); "
                f"{name} has {'.'.join(map(str, torch.cuda.get_device_capability(device)))}."
            )
