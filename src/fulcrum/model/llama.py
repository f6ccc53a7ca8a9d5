"""Llama-family decoder (Llama 1-3, Mistral, Qwen2/3, Phi-3, Granite, SmolLM3) over a flattened
varlen batch and paged KV. SmolLM3 leaves rotary out of the layers ``no_rope_layers`` marks 0
(every fourth). Granite is Llama with four scalars: the embeddings times
``embedding_multiplier``, each attention and MLP output times ``residual_multiplier`` before it
joins the residual stream, ``attention_multiplier`` as the softmax scale, and the logits divided
by ``logits_scaling``.

Parameter names follow Hugging Face's checkpoints except for two fusions: ``q/k/v_proj`` are one
``qkv_proj`` and ``gate/up_proj`` are one ``gate_up_proj``; ``load_weights`` maps the shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fulcrum.attention.backend import AttentionBackend, AttentionMetadata, QKNorm
from fulcrum.config import KernelConfig
from fulcrum.distributed.layers import local_args, parallelize
from fulcrum.distributed.parallel_state import tp_size
from fulcrum.kernels.dispatch import DEFAULT, Configured, set_kernel_config
from fulcrum.kv_cache.sliding_window import layer_windows, rope_layers
from fulcrum.model.layers.linear import Linear, RopeKV, norm_linear, norm_linear_rope, silu_linear
from fulcrum.model.layers.norm import RMSNorm
from fulcrum.model.layers.rotary import RotaryEmbedding
from fulcrum.quant.base import QuantMethod


def _linear(in_features: int, out_features: int, bias: bool, quant: QuantMethod | None):
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    return quant.linear(in_features, out_features, bias)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position: int
    # Qwen3: an RMSNorm over each head of q and of k, before rotary.
    qk_norm: bool = False
    # Granite's scalars (1.0 / None elsewhere: no extra operation).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the softmax scale (None: head_dim ** -0.5)
    logits_scaling: float = 1.0
    o_bias: bool = False  # Llama/Granite's attention_bias: o_proj too, not only q/k/v

    @classmethod
    def from_hf(cls, c, max_position: int) -> ModelArgs:
        n_heads = c.num_attention_heads
        arch = (getattr(c, "architectures", None) or [""])[0]
        if getattr(c, "mlp_bias", False):
            raise ValueError("mlp_bias: MLP projections with biases are not supported.")
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=n_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // n_heads,
            rms_norm_eps=c.rms_norm_eps,
            qkv_bias=bool(getattr(c, "attention_bias", False)) or arch.startswith("Qwen2"),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            max_position=max_position,
            qk_norm=arch.startswith("Qwen3"),  # Qwen3 and Qwen3Moe
            embedding_multiplier=float(getattr(c, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(c, "residual_multiplier", 1.0)),
            attention_multiplier=getattr(c, "attention_multiplier", None),
            logits_scaling=float(getattr(c, "logits_scaling", 1.0)),
            o_bias=bool(getattr(c, "attention_bias", False)),
        )


class Attention(Configured, nn.Module):
    def __init__(
        self,
        a: ModelArgs,
        rope: RotaryEmbedding | None,  # None: this layer applies no rotary
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.a = a
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = _linear(a.hidden_size, qkv, a.qkv_bias, quant)
        self.o_proj = _linear(self.q_size, a.hidden_size, a.o_bias, quant)
        self.rope = rope
        self.backend = backend
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def project(
        self, norm, x, residual, positions, kv_cache, slot_mapping
    ) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, residual)``: the layer's input normed (with the residual add) and
        projected, q ``[T, heads, D]`` and k, v ``[T, kv_heads, D]``, rotary applied and this
        step's K/V rows written into ``kv_cache`` at ``slot_mapping`` -- by the projection's
        own kernel where it can (one row on CUDA), else by the backend after it."""
        a = self.a
        fused = None
        # The one-row kernel applies rotary straight after the GEMV: no room for q/k norms.
        if x.shape[0] == 1 and not a.qk_norm and self.rope is not None:  # a one-row decode step
            rope = RopeKV(
                positions, getattr(self.rope, "cos_sin_cache", None), kv_cache, slot_mapping,
                a.num_heads, a.num_kv_heads, a.head_dim,
            )  # fmt: skip
            fused = norm_linear_rope(norm, self.qkv_proj, x, residual, rope, self.kernel_config)
        qkv, residual = fused or norm_linear(norm, self.qkv_proj, x, residual, self.kernel_config)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, a.num_heads, a.head_dim)
        k = k.view(-1, a.num_kv_heads, a.head_dim)
        v = v.view(-1, a.num_kv_heads, a.head_dim)
        qk_norm = self._qk_norm() if a.qk_norm else None
        if qk_norm is not None and self.rope is None:
            q, k = qk_norm.q(q.contiguous()), qk_norm.k(k.contiguous())
        if fused is None and self.rope is None:  # a layer without rotary (SmolLM3's NoPE)
            self.backend.write_kv(k, v, kv_cache, slot_mapping)
        elif fused is None:  # the backend may norm q and k in its rotary kernel
            q, k = self.backend.rope_and_write_kv(
                self.rope, positions, q, k, v, kv_cache, slot_mapping, qk_norm
            )
        return q, k, v, residual

    def _qk_norm(self) -> QKNorm:
        qn, kn = self.q_norm, self.k_norm
        plain = type(qn) is RMSNorm and type(kn) is RMSNorm and qn.eps == kn.eps
        return QKNorm(qn, kn, (qn.weight, kn.weight, qn.eps) if plain else None)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The attention rows ``[T, heads * D]`` (``o_proj``'s input)."""
        return self.backend.attend(q, k, v, kv_cache, meta).reshape(-1, self.q_size)


class MLP(Configured, nn.Module):
    def __init__(self, a: ModelArgs, quant: QuantMethod | None = None) -> None:
        super().__init__()
        self.gate_up_proj = _linear(a.hidden_size, 2 * a.intermediate_size, False, quant)
        self.down_proj = _linear(a.intermediate_size, a.hidden_size, False, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_linear(self.gate_up_proj(x), self.down_proj, self.kernel_config)


class DecoderLayer(Configured, nn.Module):
    def __init__(
        self,
        a: ModelArgs,
        rope: RotaryEmbedding | None,
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(a, rope, backend, quant)
        self.mlp = MLP(a, quant)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    # ``(x, residual)`` between layers: the hidden state is ``x + residual`` (``residual`` None
    # for the embedding).
    def forward(self, x, residual, positions, kv_cache, meta):
        q, k, v, residual = self.before_attention(
            x, residual, positions, kv_cache, meta.slot_mapping
        )
        return self.after_attention(self.self_attn(q, k, v, kv_cache, meta), residual)

    # The layer in two halves around attention, for CUDA graphs captured piecewise.
    def before_attention(self, x, residual, positions, kv_cache, slot_mapping):
        """``(q, k, v, residual)`` of this layer's input (its K/V rows written)."""
        attn = self.self_attn
        return attn.project(self.input_layernorm, x, residual, positions, kv_cache, slot_mapping)

    def after_attention(self, o, residual):
        """``(output, residual)`` from the attention rows ``o`` (``o_proj``'s input)."""
        m = self.self_attn.a.residual_multiplier
        attn = self.self_attn.o_proj(o)
        out, residual = norm_linear(
            self.post_attention_layernorm,
            self.mlp.gate_up_proj,
            attn if m == 1.0 else attn * m,
            residual,
            self.kernel_config,
            silu=True,
            then=self.mlp.down_proj,
        )
        return out if m == 1.0 else out * m, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        a: ModelArgs,
        hf_config,
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
        layer_cls: type[nn.Module] = DecoderLayer,  # moe.py: the mixture-of-experts layer
    ) -> None:
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        rope = RotaryEmbedding(hf_config, a.head_dim, a.max_position)
        # A sliding layer (or one with its own softmax scale) attends through its own copy of
        # the backend holding its window and scale.
        scale = a.attention_multiplier
        backends = [
            backend if w is None and scale is None
            else backend.for_layer(backend.scale if scale is None else scale, w, None)
            for w in layer_windows(hf_config, a.max_position)
        ]
        self.layers = nn.ModuleList(
            layer_cls(a, rope if r else None, b, quant)
            for r, b in zip(rope_layers(hf_config), backends, strict=True)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def _embed(self, input_ids) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.a.embedding_multiplier == 1.0 else x * self.a.embedding_multiplier

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        x, residual = self._embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    # The forward as segments between attention calls (worker/piecewise_graph.py):
    #   segment 0        embed -> layer 0 before attention                   -> q, k, v, residual
    #   segment i (1..L-1)  layer i-1 after attention (o_proj of its rows) -> layer i before
    #   segment L        layer L-1 after attention -> final norm                -> hidden states
    # with each layer's attention (reading q, k, v and the cache; writing rows ``o``) between
    # them. Segment i < L writes layer i's K/V rows into ``kv_cache`` at ``slots``.
    def segment(
        self, i: int, positions, slots, kv_cache=None, input_ids=None, o=None, residual=None
    ):
        if i == 0:
            x = self._embed(input_ids)
            return self.layers[0].before_attention(x, None, positions, kv_cache, slots)
        prev = self.layers[i - 1]
        x, residual = prev.after_attention(o.reshape(-1, prev.self_attn.q_size), residual)
        if i < len(self.layers):
            return self.layers[i].before_attention(x, residual, positions, kv_cache, slots)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """``quant``: the method whose linear layers the decoder's projections use (None: the
    model's dtype); embeddings, norms and the LM head stay unquantized. ``kernel_config``: the
    engine's kernel switches, handed to every layer and to the attention backend."""

    def __init__(
        self,
        hf_config,
        max_position: int,
        backend: AttentionBackend,
        quant: QuantMethod | None = None,
        kernel_config: KernelConfig = DEFAULT,
    ) -> None:
        super().__init__()
        args = self.model_args(hf_config, max_position)
        if (world := tp_size()) > 1:  # this rank's heads and MLP slice (distributed/layers.py)
            args = local_args(args, world)
        self.args, self.backend = args, backend
        self.model = self.decoder(args, hf_config, backend, quant)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_kernel_config(kernel_config)
        if world > 1:
            parallelize(self)

    # What a family changes: its arguments from the config, and its decoder stack. The LM head
    # (tied to the embedding where the config says so), the kernel switches, tensor
    # parallelism (for the architectures distributed/validate.py admits) and weight loading
    # are shared.
    def model_args(self, hf_config, max_position: int) -> ModelArgs:
        return ModelArgs.from_hf(hf_config, max_position)

    def decoder(
        self, args: ModelArgs, hf_config, backend: AttentionBackend, quant: QuantMethod | None
    ) -> nn.Module:
        return LlamaModel(args, hf_config, backend, quant)

    def set_kernel_config(self, kc: KernelConfig) -> None:
        """Every layer and the attention backend take ``kc`` from their next call on (a
        captured CUDA graph keeps the launches it captured)."""
        self.kernel_config = kc
        self.backend.kernel_config = kc
        for layer in self.model.layers:  # per-layer copies (sliding windows, Gemma's caps)
            layer.self_attn.backend.kernel_config = kc
        set_kernel_config(self, kc)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``/``positions``: [num_tokens]; returns hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        s = self.args.logits_scaling
        return logits if s == 1.0 else logits / s

    # -- weights ------------------------------------------------------------------------------

    _FUSED = {  # checkpoint name fragment -> (fused param fragment, shard index)
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def _shard_offsets(self, fused: str, shard: int) -> tuple[int, int]:
        a = self.args
        if fused == ".qkv_proj.":
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        i = a.intermediate_size
        return (shard * i, i)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the parameter names that were set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            target, offset = name, None
            for frag, (fused, shard) in self._FUSED.items():
                if frag in name:
                    target = name.replace(frag, fused)
                    offset = self._shard_offsets(fused, shard)
                    break
            if target not in params:
                raise ValueError(f"model weights: unexpected tensor {name!r} in the checkpoint.")
            p = params[target]
            owner_name, leaf = target.rsplit(".", 1)
            load_packed = getattr(self.get_submodule(owner_name), "load_packed", None)
            if load_packed is not None and load_packed(leaf, tensor, offset):  # GPTQ/AWQ
                loaded.add(f"{target}#{offset}")
                continue
            dst = p.data if offset is None else p.data.narrow(0, offset[0], offset[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"model weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}."
                )
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            if target.endswith(".weight") and hasattr(owner, "weight_loader"):
                owner.weight_loader(tensor, 0 if offset is None else offset[0])  # quantizes
            else:
                dst.copy_(tensor)
            if (
                offset is None
                and ".weight" in target
                and (".qkv_proj." in target or ".gate_up_proj." in target)
            ):
                # A checkpoint with the projection already fused (Phi-3) fills every shard.
                fused = ".qkv_proj." if ".qkv_proj." in target else ".gate_up_proj."
                n = 3 if fused == ".qkv_proj." else 2
                loaded.update(f"{target}#{self._shard_offsets(fused, i)}" for i in range(n))
            else:
                loaded.add(f"{target}#{offset}")
        return loaded

    def expected_weight_count(self) -> int:
        n = 0
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            # one checkpoint tensor per shard of a fused projection, whatever the format's names
            n += 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
        return n
