"""OLMo 2 (``Olmo2ForCausalLM``) over a flattened varlen batch and paged KV.

The Llama family's projections, SiLU MLP, rotary and weight names, with two differences: the norms
come after each sublayer instead of before it, and q and k are each normed over all their heads
together (one RMSNorm of ``heads * head_dim``) before rotary::

    h = h + post_attention_layernorm(attention(h))
    h = h + post_feedforward_layernorm(mlp(h))

The hidden state rides between layers as a single tensor (there is no pre-norm to fuse the
residual add into), as in gemma.py (``layers/stack.py``).
"""

from __future__ import annotations

from torch import nn

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata
from fulcrum.kernels.dispatch import Configured
from fulcrum.kv_cache.sliding_window import layer_windows
from fulcrum.model.layers.norm import RMSNorm
from fulcrum.model.layers.rotary import RotaryEmbedding
from fulcrum.model.layers.stack import HiddenStateStack
from fulcrum.model.llama import MLP, LlamaForCausalLM, ModelArgs, _linear


class Olmo2Attention(Configured, nn.Module):
    def __init__(
        self, a: ModelArgs, rope: RotaryEmbedding, backend: AttentionBackend, quant
    ) -> None:
        super().__init__()
        self.a = a
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = _linear(a.hidden_size, self.q_size + 2 * self.kv_size, a.qkv_bias, quant)
        self.o_proj = _linear(self.q_size, a.hidden_size, a.o_bias, quant)
        self.q_norm = RMSNorm(self.q_size, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, a.rms_norm_eps)
        self.rope = rope
        self.backend = backend

    def project(self, x, positions, kv_cache, slot_mapping):
        """``(q, k, v)`` of the layer's input, normed, rotary applied and the K/V rows written."""
        a = self.a
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(-1, a.num_heads, a.head_dim)
        k = self.k_norm(k.contiguous()).view(-1, a.num_kv_heads, a.head_dim)
        v = v.reshape(-1, a.num_kv_heads, a.head_dim)
        q, k = self.backend.rope_and_write_kv(self.rope, positions, q, k, v, kv_cache, slot_mapping)
        return q, k, v

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata):
        """The attention rows ``[T, heads * D]`` (``o_proj``'s input)."""
        return self.backend.attend(q, k, v, kv_cache, meta).reshape(-1, self.q_size)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, rope: RotaryEmbedding, backend, quant) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(a, rope, backend, quant)
        self.mlp = MLP(a, quant)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, positions, kv_cache, meta):
        q, k, v, x = self.before_attention(x, positions, kv_cache, meta.slot_mapping)
        return self.after_attention(self.self_attn(q, k, v, kv_cache, meta), x)

    # The layer in two halves around attention, for CUDA graphs captured piecewise; the hidden
    # state ``x`` rides along as the residual.
    def before_attention(self, x, positions, kv_cache, slot_mapping):
        return (*self.self_attn.project(x, positions, kv_cache, slot_mapping), x)

    def after_attention(self, o, x):
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(HiddenStateStack):
    def __init__(self, a: ModelArgs, c, backend: AttentionBackend, quant) -> None:
        super().__init__()
        if any(w is not None for w in layer_windows(c, a.max_position)):
            raise ValueError("sliding_window: OLMo 2 layers attend to every key; got a window.")
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        rope = RotaryEmbedding(c, a.head_dim, a.max_position)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(a, rope, backend, quant) for _ in range(a.num_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2; checkpoint loading as the Llama family's (q/k/v and gate/up fused on load)."""

    def decoder(self, args, hf_config, backend: AttentionBackend, quant) -> nn.Module:
        return Olmo2Model(args, hf_config, backend, quant)
