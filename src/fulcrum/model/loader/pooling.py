"""Which runner a model gets (text or embeddings) and how an embedding model pools.

``runner="auto"`` serves a bare decoder (``Qwen3Model``, ``MistralModel``: a checkpoint with no
LM head) as an embedding model and every ``...ForCausalLM`` as a text model; ``"pooling"`` turns
a causal LM's checkpoint into an embedding model too (Qwen3-Embedding ships as
``Qwen3ForCausalLM``). The pooling type and the normalization come from the request's engine
arguments, else from a sentence-transformers layout beside the weights (``modules.json``, its
``Pooling`` module's ``config.json`` and whether a ``Normalize`` module follows), else ``last``
and normalized, what decoder embedding models use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from fulcrum.config import ModelConfig, PoolerConfig
from fulcrum.model.registry import causal_lm_of, is_classifier, is_encoder

RUNNERS = ("auto", "generate", "pooling")

# sentence-transformers' Pooling config keys -> PoolerConfig.pooling_type
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def resolve_pooler(
    runner: str, pooling_type: str | None, normalize: str, mc: ModelConfig
) -> PoolerConfig | None:
    """The model's ``PoolerConfig`` (None: it generates text). ``normalize``: auto, on, off.
    ValueError naming the field for a combination that cannot work."""
    if runner not in RUNNERS:
        raise ValueError(f"runner: expected one of {', '.join(RUNNERS)}, got {runner!r}.")
    if normalize not in ("auto", "on", "off"):
        raise ValueError(f"embedding_normalize: expected auto, on or off, got {normalize!r}.")
    encoder = is_encoder(mc.architecture)
    bare = causal_lm_of(mc.architecture) is not None or encoder
    if runner == "auto":
        runner = "pooling" if bare else "generate"
    if runner == "generate":
        if bare:
            raise ValueError(
                f"runner: {mc.architecture} has no LM head (an encoder's, an embedding "
                "model's or a classifier's checkpoint); serve it with runner pooling."
            )
        if pooling_type is not None:
            raise ValueError("pooling_type: applies to runner pooling only.")
        return None
    if is_classifier(mc.architecture):
        # transformers' classifiers score the last token's hidden state (an encoder's: the
        # first), unnormalized
        token = "cls" if encoder else "last"
        if pooling_type not in (None, token):
            where = "first" if encoder else "last"
            raise ValueError(
                f"pooling_type: {mc.architecture} scores the {where} token; got {pooling_type!r}."
            )
        tokens = getattr(mc.hf_config, "classifier_from_token", None)
        if tokens and encoder:
            raise ValueError(f"classifier_from_token: {mc.architecture} has its own head.")
        if tokens:
            ids = _token_ids(mc, tokens)
            return PoolerConfig("last", False, 1 if len(ids) == 2 else len(ids), ids)
        # config.json stores the labels as id2label (transformers derives num_labels from it)
        id2label = getattr(mc.hf_config, "id2label", None)
        labels = len(id2label) if id2label else int(getattr(mc.hf_config, "num_labels", 0) or 0)
        if labels < 1:
            raise ValueError(f"num_labels: {mc.architecture}'s config names no labels.")
        sep = _pair_separator(mc) if encoder else None
        return PoolerConfig(token, normalize=False, num_labels=labels, bidirectional=encoder,
                            sep_token_id=sep)  # fmt: skip
    st = _sentence_transformers(mc.weights_path)
    if pooling_type is None:  # an encoder's summary is its first token ([CLS], <s>)
        pooling_type = st[0]() if st is not None else "cls" if encoder else "last"
    if normalize == "auto":
        norm = st[1] if st is not None else True
    else:
        norm = normalize == "on"
    return PoolerConfig(pooling_type, norm, bidirectional=encoder)


def _pair_separator(mc: ModelConfig) -> int | None:
    """The tokenizer's separator, where a cross-encoder tells a pair's two texts apart by token
    type (BERT: two types; RoBERTa's single type needs none)."""
    if int(getattr(mc.hf_config, "type_vocab_size", 1) or 1) < 2 or mc.tokenizer_path is None:
        return None
    from fulcrum.model.loader.tokenizer import load_tokenizer

    return getattr(load_tokenizer(mc), "sep_token_id", None)


def _token_ids(mc: ModelConfig, tokens: list[str]) -> tuple[int, ...]:
    """``classifier_from_token``'s ids: each must be one token of the model's vocabulary."""
    if mc.tokenizer_path is None:
        raise ValueError("classifier_from_token: the model has no tokenizer to read its tokens.")
    from fulcrum.model.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(mc)
    ids = []
    for t in tokens:
        found = tok(t, add_special_tokens=False).input_ids
        if len(found) != 1:
            raise ValueError(f"classifier_from_token: {t!r} is {len(found)} tokens, not one.")
        ids.append(int(found[0]))
    return tuple(ids)


def _sentence_transformers(path: str) -> tuple[Callable[[], str], bool] | None:
    """From a sentence-transformers layout in ``path``: a function giving its pooling type
    (called only where none is passed: a mode fulcrum does not run fails there, naming the
    file and its key) and whether it normalizes; None if there is no such layout."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as fh:
        modules = json.load(fh)
    kinds = [str(m.get("type", "")) for m in modules]
    normalize = any(k.endswith(".Normalize") for k in kinds)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    cfg_file = os.path.join(path, pooling.get("path", "") if pooling else "", "config.json")

    def pooling_type() -> str:
        if pooling is None or not os.path.isfile(cfg_file):
            return "last"
        with open(cfg_file) as fh:
            cfg = json.load(fh)
        on = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v is True]
        if any(k not in _ST_MODES for k in on) or len(on) > 1:
            raise ValueError(
                f"pooling_type: {cfg_file} sets {', '.join(on)}; fulcrum pools by one of "
                f"{', '.join(_ST_MODES)} (pass pooling_type to choose)."
            )
        return _ST_MODES[on[0]] if on else "last"

    return pooling_type, normalize
