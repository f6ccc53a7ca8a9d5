"""Maps a config's ``architectures`` entry to the model class that runs it."""

from __future__ import annotations

from torch import nn

from fulcrum.model.bert import BertEncoderModel
from fulcrum.model.gemma import GemmaForCausalLM
from fulcrum.model.llama import LlamaForCausalLM
from fulcrum.model.moe import MixtralForCausalLM
from fulcrum.model.olmo2 import Olmo2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,  # text only
    "GraniteForCausalLM": LlamaForCausalLM,  # + embedding/residual/attention/logit scalars
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,  # fused Triton experts on CUDA
    "Olmo2ForCausalLM": Olmo2ForCausalLM,  # norms after each sublayer; q/k normed whole
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": MixtralForCausalLM,  # + a shared expert behind a sigmoid gate
    "Phi3ForCausalLM": LlamaForCausalLM,  # checkpoint's qkv/gate_up already fused; LongRoPE
    "Qwen3MoeForCausalLM": MixtralForCausalLM,  # + per-head q/k RMSNorm
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k RMSNorm (ModelArgs.qk_norm)
    "SmolLM3ForCausalLM": LlamaForCausalLM,  # rotary left out of every fourth layer
}


# Encoders (bidirectional attention): embedding models only (``runner="pooling"``).
_ENCODERS: dict[str, type[nn.Module]] = {
    "BertModel": BertEncoderModel,
    "RobertaModel": BertEncoderModel,  # positions offset past the padding index
    "XLMRobertaModel": BertEncoderModel,
    # cross-encoders: the first token's hidden state through the checkpoint's own head
    "BertForSequenceClassification": BertEncoderModel,
    "RobertaForSequenceClassification": BertEncoderModel,
    "XLMRobertaForSequenceClassification": BertEncoderModel,
}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_ENCODERS])


def is_encoder(architecture: str) -> bool:
    """An encoder: each prompt attends both ways, and is served as embeddings only."""
    return architecture in _ENCODERS


_CLASSIFIER = "ForSequenceClassification"


def is_classifier(architecture: str) -> bool:
    """A sequence classifier: a decoder, its last token's hidden state, a ``score`` head (or an
    encoder, its first token's, the checkpoint's own head)."""
    return architecture.endswith(_CLASSIFIER) and (
        causal_lm_of(architecture) is not None or architecture in _ENCODERS
    )


def causal_lm_of(architecture: str) -> str | None:
    """The ``...ForCausalLM`` whose decoder a bare ``...Model`` architecture (an embedding
    checkpoint without an LM head, e.g. ``Qwen3Model``, ``MistralModel``) or a
    ``...ForSequenceClassification`` is, else None."""
    if architecture.endswith(_CLASSIFIER):
        name = architecture[: -len(_CLASSIFIER)] + "ForCausalLM"
        return name if name in _MODELS else None
    if not architecture.endswith("Model") or architecture in _MODELS:
        return None
    stem = architecture[: -len("Model")]
    stem = stem[: -len("Text")] if stem.endswith("Text") else stem  # Gemma3TextModel
    name = stem + "ForCausalLM"
    return name if name in _MODELS else None


def get_model_cls(architecture: str) -> type[nn.Module]:
    if architecture in _ENCODERS:
        return _ENCODERS[architecture]
    name = causal_lm_of(architecture) or architecture
    if name not in _MODELS:
        raise ValueError(
            f"architectures: unknown architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())} (and their bare ...Model decoders and "
            "...ForSequenceClassification heads, served by runner pooling)."
        )
    return _MODELS[name]
