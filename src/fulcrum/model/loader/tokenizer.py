"""The model's tokenizer (chat template from the tokenizer config or GGUF metadata)."""

from __future__ import annotations

from fulcrum.config import ModelConfig


def load_tokenizer(mc: ModelConfig):
    """Return the HF fast tokenizer, or None for token-id-only use (dummy weights, no tokenizer)."""
    if mc.tokenizer_path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(mc.tokenizer_path)
    except Exception as e:
        raise ValueError(f"tokenizer: cannot load from {mc.tokenizer_path!r}: {e}") from None
