"""Embeddings from an embedding model (``runner="pooling"``): the request's parameters and the
vector a user gets, shared by ``LLM.embed`` and ``POST /v1/embeddings``.

The engine returns each prompt's pooled hidden states unnormalized (``worker/pooler.py``); a
request's ``dimensions`` (Matryoshka embeddings: the first ``d`` components carry the most)
cut the vector first, then it is scaled to unit length where the model normalizes, as
sentence-transformers and OpenAI's ``dimensions`` do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fulcrum.config import PoolerConfig
from fulcrum.sampling_params import SamplingParams


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's shape: ``.outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def embedding_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """An embedding request's engine parameters: its prompt is computed and pooled; the one
    token the engine samples after it (greedy, over an embedding model's zero logits) is
    dropped, so a prompt may hold up to ``max_model_len - 1`` tokens."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=truncate_prompt_tokens
    )


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """ValueError naming ``dimensions`` unless it is None or in [1, hidden_size]."""
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ValueError(
            f"dimensions must be in [1, {hidden_size}] (the model's embedding size), got "
            f"{dimensions}."
        )


def finish_embedding(pooled: bytes, config: PoolerConfig, dimensions: int | None) -> np.ndarray:
    """The user's vector (float32): cut to ``dimensions``, then normalized if the model is."""
    vec = np.frombuffer(pooled, dtype=np.float32)
    if dimensions is not None:
        vec = vec[:dimensions]
    if config.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec
