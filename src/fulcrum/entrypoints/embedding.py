"""Embeddings from an embedding model (``runner="pooling"``): the request's parameters and the
vector a user gets, shared by ``LLM.embed`` and ``POST /v1/embeddings``.

The engine returns each prompt's pooled hidden states unnormalized (``worker/pooler.py``); a
request's ``dimensions`` (Matryoshka embeddings: the first ``d`` components carry the most)
cut the vector first, then it is scaled to unit length where the model normalizes, as
sentence-transformers and OpenAI's ``dimensions`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fulcrum.config import PoolerConfig
from fulcrum.sampling_params import SamplingParams


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (one label: its sigmoid)
    logits: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.logits)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s result for one prompt (``.outputs.probs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # a classifier's sigmoid, or the cosine of two embeddings


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair (``.outputs.score``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


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


def classification(pooled: bytes) -> ClassificationOutput:
    """A classifier's logits (float32 bytes) and their probabilities."""
    logits = np.frombuffer(pooled, dtype=np.float32).astype(np.float64)
    if len(logits) == 1:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max())
        probs = e / e.sum()
    return ClassificationOutput(probs.tolist(), logits.tolist())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))


def finish_embedding(pooled: bytes, config: PoolerConfig, dimensions: int | None) -> np.ndarray:
    """The user's vector (float32): cut to ``dimensions``, then normalized if the model is."""
    vec = np.frombuffer(pooled, dtype=np.float32)
    if dimensions is not None:
        vec = vec[:dimensions]
    if config.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec


def score_plan(
    tokenizer: Any, config: PoolerConfig, text_1: Sequence[str], text_2: Sequence[str]
) -> tuple[list[list[int]], Callable[[list[bytes]], list[float]]]:
    """The prompts that score ``text_2[i]`` against ``text_1[i]`` and how their pooled vectors
    become the scores: a one-label classifier (a cross-encoder reranker) reads each pair as one
    prompt (the tokenizer's pair encoding) and scores its sigmoid; an embedding model embeds
    every text and scores each pair's cosine. ValueError naming the field at fault."""
    if len(text_1) != len(text_2) or not text_2:
        raise ValueError(f"text_1: pass one text or one per text_2 ({len(text_2)}), got {len(text_1)}.")
    if tokenizer is None:
        raise ValueError("text_1: scoring texts needs a tokenizer, and this model has none.")
    if config.num_labels:
        if config.num_labels != 1:
            raise ValueError(
                f"model: scores come from a one-label classifier; this one has {config.num_labels} "
                "labels."
            )
        pairs = [list(tokenizer(a, b).input_ids) for a, b in zip(text_1, text_2, strict=True)]
        return pairs, lambda vecs: [classification(v).probs[0] for v in vecs]
    n = len(text_1)
    texts = [list(tokenizer(t).input_ids) for t in [*text_1, *text_2]]

    def cosines(vecs: list[bytes]) -> list[float]:
        e = [finish_embedding(v, config, None) for v in vecs]
        return [cosine(e[i], e[n + i]) for i in range(n)]

    return texts, cosines
