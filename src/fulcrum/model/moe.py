"""Mixtral, Qwen3-MoE and Qwen1.5/Qwen2-MoE: the Llama decoder with a sparse mixture-of-experts
MLP.

Each token's router logits pick its top-k experts; their softmax weights (taken over all
experts, in float32) are renormalised over the k (Mixtral; Qwen-MoE where ``norm_topk_prob``),
as transformers does. The experts are stacked for the grouped GEMMs (``layers/experts.py``):
the fused Triton kernels on CUDA, the per-expert torch loop on the CPU. Qwen2-MoE adds a shared
expert that every token runs, scaled by a sigmoid gate of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fulcrum.attention.backend import AttentionBackend
from fulcrum.kernels.dispatch import Configured
from fulcrum.model.layers.experts import Experts, routed_fast
from fulcrum.model.layers.linear import Linear
from fulcrum.model.layers.moe_ref import topk_softmax_ref
from fulcrum.model.layers.norm import RMSNorm
from fulcrum.model.layers.rotary import RotaryEmbedding
from fulcrum.model.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    ModelArgs,
)
from fulcrum.quant.base import QuantMethod


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 0
    norm_topk: bool = True
    moe_attr: str = "block_sparse_moe"  # the checkpoint's module name: Qwen-MoE's is "mlp"
    # Qwen2-MoE: a shared expert of ``intermediate_size`` rows behind a sigmoid gate
    shared_expert: bool = False


class SparseMoE(Configured, nn.Module):
    def __init__(self, a: MoEArgs, quant: QuantMethod | None) -> None:
        super().__init__()
        self.top_k, self.norm_topk = a.top_k, a.norm_topk
        self.gate = Linear(a.hidden_size, a.num_experts, bias=False)  # the router: unquantized
        fp8 = quant is not None and quant.name == "fp8"
        self.experts = Experts(a.num_experts, a.hidden_size, a.moe_intermediate, fp8)
        if a.shared_expert:
            self.shared_expert = MLP(a, quant)
            self.shared_expert_gate = Linear(a.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if routed_fast(x, self.kernel_config):
            from fulcrum.kernels.moe_routing import topk_softmax

            weights, ids = topk_softmax(logits, self.top_k, self.norm_topk)
        else:
            weights, ids = topk_softmax_ref(logits, self.top_k, self.norm_topk)
        out = self.experts(x, weights, ids)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
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
        if quant is not None and quant.name != "fp8":
            raise ValueError(
                f"quantization: {quant.name!r} is not supported for mixture-of-experts models; "
                "use fp8 or none."
            )
        self.self_attn = Attention(a, rope, backend, quant)
        assert isinstance(a, MoEArgs)
        setattr(self, a.moe_attr, SparseMoE(a, quant))
        self.moe = a.moe_attr
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def after_attention(self, o, residual):
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        return getattr(self, self.moe)(h), residual


_EXPERT = re.compile(
    r"(.*\.(?:block_sparse_moe|mlp)\.experts)\.(\d+)\."
    r"(w1|w2|w3|gate_proj|down_proj|up_proj)\.weight$"
)
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}  # else "down"


def moe_args(c, max_position: int) -> MoEArgs:
    """The model arguments of a Mixtral, Qwen3-MoE or Qwen2-MoE config."""
    arch = c.architectures[0]
    base = ModelArgs.from_hf(c, max_position)
    fields = {f: getattr(base, f) for f in ModelArgs.__dataclass_fields__}
    num_experts = getattr(c, "num_local_experts", None) or c.num_experts  # either spelling
    if arch.startswith("Mixtral"):
        return MoEArgs(
            **fields, num_experts=num_experts, top_k=c.num_experts_per_tok,
            moe_intermediate=c.intermediate_size, norm_topk=True,
        )  # fmt: skip
    if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "mlp_only_layers / decoder_sparse_step: dense layers among the sparse ones are "
            "not supported; every layer must be a mixture of experts."
        )
    qwen2 = arch.startswith("Qwen2Moe")
    if qwen2:
        shared = c.shared_expert_intermediate_size
        if not shared:
            raise ValueError("shared_expert_intermediate_size: expected a positive size.")
        # the shared expert is the layer's one dense MLP: the Llama loader's gate_up shards
        fields.update(intermediate_size=shared, qkv_bias=bool(getattr(c, "qkv_bias", True)))
    return MoEArgs(
        **fields, num_experts=num_experts, top_k=c.num_experts_per_tok,
        moe_intermediate=c.moe_intermediate_size,
        norm_topk=bool(getattr(c, "norm_topk_prob", False)), moe_attr="mlp", shared_expert=qwen2,
    )  # fmt: skip


class MixtralForCausalLM(LlamaForCausalLM):
    def model_args(self, hf_config, max_position: int) -> MoEArgs:
        return moe_args(hf_config, max_position)

    def decoder(self, args, hf_config, backend: AttentionBackend, quant) -> nn.Module:
        return LlamaModel(args, hf_config, backend, quant, MoEDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert gate/up (``w1``/``w3``) rows into ``w13`` and down (``w2``) into ``w2``
        of the layer's stacked experts; the rest as the Llama family's."""
        loaded: set[str] = set()

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _EXPERT.match(name)
                if m is None:
                    yield name, tensor
                    continue
                try:
                    experts = self.get_submodule(m.group(1))
                except AttributeError:
                    experts = None
                if not isinstance(experts, Experts):
                    raise ValueError(
                        f"model weights: unexpected tensor {name!r} in the checkpoint."
                    )
                experts.load_expert(int(m.group(2)), _PART.get(m.group(3), "down"), tensor, name)
                loaded.add(name)

        loaded |= super().load_weights(dense())
        return loaded

    def expected_weight_count(self) -> int:
        n = super().expected_weight_count()
        per_layer = 3 * self.args.num_experts - 2  # w13 and w2 counted once above
        return n + per_layer * self.args.num_layers
