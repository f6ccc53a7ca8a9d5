"""Mixtral and Qwen3-MoE: the Llama decoder with a sparse mixture-of-experts MLP (torch
reference routing).

Each token's router logits pick its top-k experts; their softmax weights (taken over all
experts, in float32) are renormalised over the k (Mixtral; Qwen3-MoE where ``norm_topk_prob``)
and cast back, as transformers does. The
experts' gate and up projections are stacked as ``w13`` ``[E, 2I, H]`` and the down
projections as ``w2`` ``[E, H, I]``: the layout a fused grouped-GEMM kernel reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.attention.backend import AttentionBackend
from fulcrum.config import KernelConfig
from fulcrum.kernels.dispatch import DEFAULT, Configured
from fulcrum.model.layers.linear import Linear
from fulcrum.model.layers.norm import RMSNorm
from fulcrum.model.layers.rotary import RotaryEmbedding
from fulcrum.model.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, ModelArgs
from fulcrum.quant.base import QuantMethod


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 0
    norm_topk: bool = True
    moe_attr: str = "block_sparse_moe"  # the checkpoint's module name: Qwen3-MoE's is "mlp"


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk: bool
    ) -> None:
        super().__init__()
        self.norm_topk = norm_topk
        self.gate = Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        return moe_reference(x, self.w13, self.w2, weights, experts)


def moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] routing weights
    experts: torch.Tensor,  # [T, k] expert ids
) -> torch.Tensor:
    """The per-expert loop: each expert runs on the rows routed to it."""
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        tok, slot = torch.where(experts == e)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


class MoEDecoderLayer(DecoderLayer):
    def __init__(
        self,
        a: ModelArgs,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
    ) -> None:
        Configured.__init__(self)
        nn.Module.__init__(self)
        if quant is not None:
            raise ValueError("quantization: mixture-of-experts models run unquantized for now.")
        self.self_attn = Attention(a, rope, backend, quant)
        assert isinstance(a, MoEArgs)
        moe = SparseMoE(a.hidden_size, a.moe_intermediate, a.num_experts, a.top_k, a.norm_topk)
        setattr(self, a.moe_attr, moe)
        self.moe = a.moe_attr
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def after_attention(self, o, residual):
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        return getattr(self, self.moe)(h), residual


_EXPERT = re.compile(
    r"(.*\.(?:block_sparse_moe|mlp)\.)experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|down_proj|up_proj)\.weight$"
)
_GATE = ("w1", "gate_proj")  # the first half of w13; w3 / up_proj the second


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        hf_config,
        max_position: int,
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
        kernel_config: KernelConfig = DEFAULT,
    ) -> None:
        nn.Module.__init__(self)
        c = hf_config
        base = ModelArgs.from_hf(c, max_position)
        qwen = c.architectures[0].startswith("Qwen3Moe")
        if qwen and (
            getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1
        ):
            raise ValueError(
                "mlp_only_layers / decoder_sparse_step: dense layers among the sparse ones are "
                "not supported; every layer must be a mixture of experts."
            )
        args = MoEArgs(
            **{f: getattr(base, f) for f in ModelArgs.__dataclass_fields__},
            num_experts=getattr(c, "num_local_experts", None) or c.num_experts,
            top_k=c.num_experts_per_tok,
            moe_intermediate=c.moe_intermediate_size if qwen else c.intermediate_size,
            norm_topk=bool(getattr(c, "norm_topk_prob", False)) if qwen else True,
            moe_attr="mlp" if qwen else "block_sparse_moe",
        )
        model = LlamaModel(args, hf_config, backend, quant, MoEDecoderLayer)
        self._assemble(args, model, backend, kernel_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert ``w1``/``w3`` (gate/up) into ``w13`` and ``w2`` into ``w2``; the rest as
        the Llama family's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        inter = self.args.moe_intermediate

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _EXPERT.match(name)
                if m is None:
                    yield name, tensor
                    continue
                prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
                down = w in ("w2", "down_proj")
                target = prefix + ("w2" if down else "w13")
                if target not in params or e >= self.args.num_experts:
                    raise ValueError(
                        f"model weights: unexpected tensor {name!r} in the checkpoint."
                    )
                dst = params[target].data[e]
                if not down:
                    dst = dst.narrow(0, 0 if w in _GATE else inter, inter)
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"model weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dst.shape)}."
                    )
                dst.copy_(tensor)
                loaded.add(name)

        loaded |= super().load_weights(dense())
        return loaded

    def expected_weight_count(self) -> int:
        n = super().expected_weight_count()
        per_layer = 3 * self.args.num_experts - 2  # w13 and w2 counted once above
        return n + per_layer * self.args.num_layers
