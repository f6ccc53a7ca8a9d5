"""Shared fixtures: the embedded model and tiny random Hugging Face models saved as safetensors."""

from __future__ import annotations

import os

import pytest
import torch

from model_factory import make_tiny_model
from triton_interp import fix_interpreter_index

# Triton decides at import whether kernels run on the GPU or in its CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


if os.environ.get("TRITON_INTERPRET") == "1":
    fix_interpreter_index()


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    """The embedded default model converted to an HF directory (cached on disk)."""
    from fulcrum.model.loader.default_model import default_model_path
    from fulcrum.model.loader.gguf_loader import convert_gguf

    return convert_gguf(default_model_path())


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_tiny_model(str(root / arch), arch, shard=(arch == "llama"))
        for arch in ("llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "mistral", "granite", "olmo2", "smollm3")
    }
