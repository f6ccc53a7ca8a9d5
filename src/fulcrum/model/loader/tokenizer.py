"""The model's tokenizer (chat template from the tokenizer config or GGUF metadata)."""

from __future__ import annotations

import os

from fulcrum.config import ModelConfig


def check_tokenizer_path(name: str | None) -> None:
    """Raise ValueError for a ``tokenizer`` that is plainly a local path (absolute, ``./``,
    ``../``) but does not exist: transformers would read it as a Hugging Face repo id and
    report a malformed id instead of the missing directory."""
    if name is None:
        return
    local = os.path.isabs(name) or name.startswith(("./", "../", ".\\", "..\\"))
    if local and not os.path.exists(name):
        raise ValueError(f"tokenizer: no such directory {name!r}.")


def load_tokenizer(mc: ModelConfig):
    """Return the HF fast tokenizer, or None for token-id-only use (dummy weights, no tokenizer)."""
    if mc.tokenizer_path is None:
        return None
    check_tokenizer_path(mc.tokenizer_path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(mc.tokenizer_path)
    except Exception as e:
        raise ValueError(f"tokenizer: cannot load from {mc.tokenizer_path!r}: {e}") from None
