"""Gemma 2 and Gemma 3 (text) decoders over a flattened varlen batch and paged KV.

What sets them apart from the Llama family (llama.py, whose weight loading they share):
embeddings scaled by sqrt(hidden); RMSNorm as ``norm(x) * (1 + weight)`` in float32; a norm
before and after both attention and the MLP; a GELU-tanh MLP; the attention scale
``query_pre_attn_scalar ** -0.5``; sliding-window layers among global ones (``layer_types``);
attention-score and final-logit soft-capping (Gemma 2); per-head q/k norms and a separate rotary
base for the sliding layers (Gemma 3).

Each layer attends through its own copy of the backend (``AttentionBackend.for_layer``) holding
its scale, window and cap. The global layers read every key, so the KV cache frees no block of
a Gemma sequence (kv_cache/sliding_window.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata
from fulcrum.kernels.dispatch import Configured
from fulcrum.kv_cache.sliding_window import SLIDING, layer_types
from fulcrum.model.layers.rotary import RotaryEmbedding
from fulcrum.model.layers.stack import HiddenStateStack
from fulcrum.model.llama import LlamaForCausalLM, ModelArgs, _linear
from fulcrum.quant.base import QuantMethod


@dataclass(frozen=True)
class GemmaArgs(ModelArgs):
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: tuple[str, ...] = ()
    gemma3: bool = False

    @classmethod
    def from_gemma(cls, c, max_position: int) -> GemmaArgs:
        arch = c.architectures[0]
        gemma3 = arch.startswith("Gemma3")
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation: {act!r} is not supported (gelu_pytorch_tanh).")
        types = layer_types(c)
        window = getattr(c, "sliding_window", None)
        heads = c.num_attention_heads
        base = ModelArgs.from_hf(c, max_position)
        return cls(
            **{f: getattr(base, f) for f in ModelArgs.__dataclass_fields__},
            query_pre_attn_scalar=float(getattr(c, "query_pre_attn_scalar", None) or heads),
            # a window as long as any sequence is full attention: no mask to apply
            sliding_window=window if window and window < max_position else None,
            attn_softcap=getattr(c, "attn_logit_softcapping", None),
            final_softcap=getattr(c, "final_logit_softcapping", None),
            layer_types=tuple(types),
            gemma3=gemma3,
        )


class _RopeView:
    """One layer type's rotary parameters as a config ``RotaryEmbedding`` reads."""

    def __init__(self, c, params: dict) -> None:
        self.rope_parameters = params
        self.rope_theta = params.get("rope_theta", 10000.0)
        self.max_position_embeddings = c.max_position_embeddings


def _rope_params(c, layer_type: str, gemma3: bool) -> dict:
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        params = dict(params[layer_type])
    elif gemma3 and layer_type == SLIDING:  # older configs: a local base, no scaling
        params = {"rope_type": "default", "rope_theta": getattr(c, "rope_local_base_freq", 1e4)}
    else:
        params = dict(params or getattr(c, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(c, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear"):
        raise ValueError(f"rope_parameters: rope_type {kind!r} is not supported for Gemma.")
    return params


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)``, all in float32, then cast (Gemma's order of operations)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Configured, nn.Module):
    def __init__(
        self, a: GemmaArgs, i: int, rope: RotaryEmbedding, backend: AttentionBackend, quant
    ) -> None:
        super().__init__()
        self.a = a
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = _linear(a.hidden_size, self.q_size + 2 * self.kv_size, a.qkv_bias, quant)
        self.o_proj = _linear(self.q_size, a.hidden_size, False, quant)
        if a.gemma3:
            self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        window = a.sliding_window if a.layer_types[i] == SLIDING else None
        self.rope = rope
        self.backend = backend.for_layer(a.query_pre_attn_scalar**-0.5, window, a.attn_softcap)

    def project(self, x, positions, kv_cache, slot_mapping) -> tuple[torch.Tensor, ...]:
        """``(q, k, v)`` of the normed input, rotary applied and the K/V rows written."""
        a = self.a
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, a.num_heads, a.head_dim)
        k = k.reshape(-1, a.num_kv_heads, a.head_dim)
        v = v.reshape(-1, a.num_kv_heads, a.head_dim)
        if a.gemma3:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.backend.rope_and_write_kv(self.rope, positions, q, k, v, kv_cache, slot_mapping)
        return q, k, v

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The attention rows ``[T, heads * D]`` (``o_proj``'s input), with this layer's
        scale, window and soft-cap."""
        return self.backend.attend(q, k, v, kv_cache, meta).reshape(-1, self.q_size)


class GemmaMLP(nn.Module):
    def __init__(self, a: GemmaArgs, quant: QuantMethod | None) -> None:
        super().__init__()
        self.gate_up_proj = _linear(a.hidden_size, 2 * a.intermediate_size, False, quant)
        self.down_proj = _linear(a.intermediate_size, a.hidden_size, False, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, a: GemmaArgs, i: int, ropes: dict, backend, quant) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(a, i, ropes[a.layer_types[i]], backend, quant)
        self.mlp = GemmaMLP(a, quant)
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, positions, kv_cache, meta) -> torch.Tensor:
        q, k, v, x = self.before_attention(x, positions, kv_cache, meta.slot_mapping)
        return self.after_attention(self.self_attn(q, k, v, kv_cache, meta), x)

    # The layer in two halves around attention, for CUDA graphs captured piecewise; the hidden
    # state ``x`` rides along as the residual.
    def before_attention(self, x, positions, kv_cache, slot_mapping):
        q, k, v = self.self_attn.project(self.input_layernorm(x), positions, kv_cache, slot_mapping)
        return q, k, v, x

    def after_attention(self, o, x) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaModel(HiddenStateStack):
    def __init__(self, a: GemmaArgs, c, backend: AttentionBackend, quant) -> None:
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        ropes = {
            t: RotaryEmbedding(
                _RopeView(c, _rope_params(c, t, a.gemma3)), a.head_dim, a.max_position
            )
            for t in sorted(set(a.layer_types))
        }
        self.rotary = nn.ModuleList(ropes.values())  # registered once, shared by the layers
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(a, i, ropes, backend, quant) for i in range(a.num_layers)
        )
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)

    def _embed(self, input_ids) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.a.hidden_size**0.5, dtype=x.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text; checkpoint loading as the Llama family's (q/k/v and gate/up
    fused on load)."""

    def model_args(self, hf_config, max_position: int) -> GemmaArgs:
        return GemmaArgs.from_gemma(hf_config, max_position)

    def decoder(self, args, hf_config, backend: AttentionBackend, quant) -> nn.Module:
        return GemmaModel(args, hf_config, backend, quant)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.args.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
