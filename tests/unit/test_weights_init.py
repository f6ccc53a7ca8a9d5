"""``model/loader/weights``: the model is built without nn's own random init, and the dummy
init (or the checkpoint) writes every parameter."""

from __future__ import annotations

import pytest
from torch import nn

from fulcrum import LLM
from fulcrum.model.loader import weights


def test_default_init_is_skipped_while_building_and_restored_after() -> None:
    calls = []
    orig = nn.Linear.reset_parameters
    nn.Linear.reset_parameters = lambda self: calls.append(1)
    try:
        with weights._no_default_init():
            nn.Linear(4, 4)
            nn.Embedding(8, 4)
        assert calls == []
        with pytest.raises(RuntimeError), weights._no_default_init():
            raise RuntimeError("a model that fails to build")
        nn.Linear(4, 4)
        assert calls == [1]  # restored, even after the failure
    finally:
        nn.Linear.reset_parameters = orig
    emb_init = nn.Embedding.reset_parameters
    with weights._no_default_init():
        assert nn.Embedding.reset_parameters is not emb_init
    assert nn.Embedding.reset_parameters is emb_init


def test_dummy_init_writes_every_parameter(tiny_models) -> None:
    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", load_format="dummy")
    for name, p in llm.core.runner.model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            assert (p == 1).all(), name
        else:
            assert p.abs().max() <= 0.02 and p.std() > 0.005, name
