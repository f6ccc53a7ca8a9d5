"""The draft model of ``speculative_config.method == "draft_model"``, resolved and checked at
start-up: its guesses are token ids of the target's vocabulary, so both must share it."""

from __future__ import annotations

import dataclasses

from fulcrum.config import ModelConfig, SpeculativeConfig

_WHERE = "speculative_config.model"


def resolve_draft_config(spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig | None:
    """The draft's ModelConfig (None unless the method is ``draft_model``): loaded like the
    target (dummy weights when the target has them), in its dtype, for its ``max_model_len``.
    A draft that cannot run beside the target raises ValueError naming the field."""
    if spec is None or spec.method != "draft_model":
        return None
    from fulcrum.model.loader.resolve import resolve_model_config

    assert spec.model is not None
    try:
        draft = resolve_model_config(
            spec.model,
            load_format="dummy" if target.load_format == "dummy" else "auto",
            dtype=target.dtype,
            max_model_len=target.max_model_len,
            seed=target.seed,
        )
    except ValueError as e:
        raise ValueError(f"{_WHERE}: {e}") from None
    if getattr(draft.hf_config, "quantization_config", None) is not None:
        raise ValueError(f"{_WHERE}: quantized draft checkpoints are not supported.")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{_WHERE}: the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}; a draft model needs the target's tokenizer."
        )
    _check_same_tokenizer(draft, target)
    return dataclasses.replace(draft, tokenizer_path=target.tokenizer_path)


def _check_same_tokenizer(draft: ModelConfig, target: ModelConfig) -> None:
    """Where both ship a tokenizer, the same strings must map to the same ids."""
    if draft.tokenizer_path is None or target.tokenizer_path is None:
        return
    if draft.tokenizer_path == target.tokenizer_path:
        return
    from fulcrum.model.loader.tokenizer import load_tokenizer

    a, b = load_tokenizer(draft).get_vocab(), load_tokenizer(target).get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))[:1]
        raise ValueError(
            f"{_WHERE}: the draft's tokenizer differs from the target's (e.g. {diff[0]!r}); "
            "a draft model needs the target's tokenizer."
        )
