"""``config.json`` as an attribute object, without importing transformers' model packages.

Importing a transformers config class (``LlamaConfig``...) pulls in its modeling, generation and
multimodal helpers, and with them whatever optional packages the environment has (torchvision,
scikit-learn: seconds of start-up on a serving host). The engine needs a few dozen plain fields,
so it reads the JSON and fills the defaults the Llama, Mistral and Qwen2 configs use. The raw
dictionary stays available (``to_dict``) for the rare path that needs the real class.
"""

from __future__ import annotations

import json
import os
from typing import Any

# Defaults of transformers' LlamaConfig / MistralConfig / Qwen2Config where a config.json
# leaves a field out (save_pretrained writes every field; hand-written configs may not).
_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "head_dim": None,
    "num_key_value_heads": None,
    "eos_token_id": None,
    "bos_token_id": None,
    "architectures": None,
}


class HFConfig:
    """Attribute access over a model's ``config.json`` (plus the defaults above)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = dict(raw)
        for key, value in {**_DEFAULTS, **raw}.items():
            setattr(self, key, value)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._raw)

    def __repr__(self) -> str:
        return f"HFConfig({self._raw.get('model_type')!r}, {self._raw.get('architectures')})"


def load_hf_config(config_file: str) -> HFConfig:
    try:
        with open(config_file) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model: cannot read config {config_file!r}: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"model: config {config_file!r} has no model_type.")
    return HFConfig(raw)


def transformers_config(config: Any):
    """The matching transformers config object (imports its model package: slow, rarely needed)."""
    if not isinstance(config, HFConfig):
        return config
    from transformers import AutoConfig

    raw = config.to_dict()
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def generation_eos_token_ids(*model_dirs: str | None) -> set[int]:
    """The EOS ids of the first ``generation_config.json`` found in ``model_dirs`` (a file path
    stands for its directory). Chat models list their end-of-turn tokens there, beside the
    ``config.json`` EOS (Llama 3 Instruct: ``<|eot_id|>``), and generation stops on any of them."""
    for path in model_dirs:
        if not path:
            continue
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as fh:
                eos = json.load(fh).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"model: cannot read {file!r}: {e}") from None
        return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return set()
