"""Turn what the user named (nothing, a directory, a .gguf file, a configs/ name) into a ModelConfig."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from fulcrum import envs
from fulcrum.config import ModelConfig

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
CONFIGS_DIR = envs.FULCRUM_CONFIGS_DIR.get() or os.path.join(_REPO_ROOT, "configs")
_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _find_config(name: str) -> str | None:
    """A configs/ entry by file or bare name (``llama-3.1-8b`` → configs/llama-3.1-8b.json)."""
    for cand in (name, os.path.join(CONFIGS_DIR, name), os.path.join(CONFIGS_DIR, name + ".json")):
        if os.path.isfile(cand) and cand.endswith(".json"):
            return cand
        if os.path.isdir(cand) and os.path.isfile(os.path.join(cand, "config.json")):
            return os.path.join(cand, "config.json")
    return None


def _has_tokenizer(directory: str) -> bool:
    """A Hugging Face tokenizer lives beside the config (a model directory, or a dummy-weights
    directory that keeps the real model's tokenizer files)."""
    return any(
        os.path.isfile(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer.model")
    )


def _named_tokenizer(name: str, cfg_file: str, vocab_size: int) -> str:
    """A dummy-weights config may borrow a tokenizer (``"fulcrum_tokenizer": "embedded"``): a
    server then has real text, chat templates and detokenization on a large model's shapes,
    without downloading that model's tokenizer. Its vocabulary must cover the model's."""
    if name != "embedded":
        raise ValueError(
            f"fulcrum_tokenizer: {cfg_file} names {name!r}; the only named tokenizer is 'embedded'."
        )
    from fulcrum.model.loader.default_model import default_model_path
    from fulcrum.model.loader.gguf_loader import convert_gguf

    directory = convert_gguf(default_model_path())
    with open(os.path.join(directory, "config.json")) as fh:
        tok_vocab = int(json.load(fh)["vocab_size"])
    if vocab_size != tok_vocab:
        raise ValueError(
            f"vocab_size: {cfg_file} has {vocab_size}, the embedded tokenizer {tok_vocab}."
        )
    return directory


def _load_hf_config(config_file: str):
    from fulcrum.model.loader.hf_config import load_hf_config

    return load_hf_config(config_file)


def resolve_model_config(
    model: str | None,
    *,
    tokenizer: str | None = None,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    seed: int = 0,
    hf_overrides: dict[str, Any] | None = None,
) -> ModelConfig:
    """``hf_overrides``: config.json fields replaced before anything reads them (vLLM's
    ``--hf-overrides``: another architecture, a longer context, a classifier's label tokens)."""
    from fulcrum.model.loader.default_model import default_model_path
    from fulcrum.model.registry import get_model_cls

    if load_format not in _FORMATS:
        raise ValueError(f"load_format: unknown format {load_format!r}; choose {', '.join(_FORMATS)}.")
    if model is None:
        model = default_model_path()
    if load_format == "dummy":
        cfg_file = _find_config(model)
        if cfg_file is None:
            raise ValueError(
                f"model: no config.json for {model!r} (looked in the path and in {CONFIGS_DIR})."
            )
        weights_path = os.path.dirname(cfg_file)
        hf_config = _load_hf_config(cfg_file)
        tok = tokenizer or (weights_path if _has_tokenizer(weights_path) else None)
        if tok is None and getattr(hf_config, "fulcrum_tokenizer", None) is not None:
            tok = _named_tokenizer(hf_config.fulcrum_tokenizer, cfg_file, hf_config.vocab_size)
    elif model.endswith(".gguf") or load_format == "gguf":
        if not os.path.isfile(model):
            raise ValueError(f"model: GGUF file {model!r} does not exist.")
        from fulcrum.model.loader.gguf_loader import gguf_metadata_dir

        load_format = "gguf"
        weights_path = gguf_metadata_dir(model)  # config and tokenizer; weights at load
        tok = tokenizer or weights_path
        hf_config = _load_hf_config(os.path.join(weights_path, "config.json"))
    else:
        if not os.path.isdir(model):
            raise ValueError(f"model: {model!r} is neither a directory nor a .gguf file.")
        cfg_file = os.path.join(model, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"model: {model!r} has no config.json.")
        load_format, weights_path = "safetensors", model
        hf_config = _load_hf_config(cfg_file)
        tok = tokenizer or (model if _has_tokenizer(model) else None)
    if hf_overrides:
        from fulcrum.model.loader.hf_config import HFConfig

        hf_config = HFConfig({**hf_config.to_dict(), **hf_overrides})
    archs = getattr(hf_config, "architectures", None)
    if not archs:
        raise ValueError(f"architectures: config of {model!r} names no architecture.")
    cls = get_model_cls(archs[0])  # unknown architecture → ValueError naming the field
    if hasattr(cls, "max_positions"):  # a position table that starts past an offset
        limit = cls.max_positions(hf_config)
    else:
        limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
    elif max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}."
        )
    return ModelConfig(
        model=model,
        hf_config=hf_config,
        weights_path=weights_path,
        tokenizer_path=tok,
        load_format=load_format,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
    )
