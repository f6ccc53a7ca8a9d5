"""Every configs/ entry names a registered architecture and builds its model arguments and
rotary tables (the shapes the dummy-weight benchmarks run), without allocating the model."""

from __future__ import annotations

import os

import pytest

from fulcrum.model.layers.rotary import compute_inv_freq
from fulcrum.model.llama import ModelArgs
from fulcrum.model.loader.hf_config import load_hf_config
from fulcrum.model.loader.resolve import CONFIGS_DIR
from fulcrum.model.registry import get_model_cls

ENTRIES = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


def test_new_entries_present():
    assert {"qwen3-8b.json", "phi-3-mini.json"} <= set(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES)
def test_config_entry_builds_model_args(entry):
    cfg = load_hf_config(os.path.join(CONFIGS_DIR, entry))
    get_model_cls(cfg.architectures[0])
    a = ModelArgs.from_hf(cfg, max_position=2047)
    inv, _ = compute_inv_freq(cfg, a.head_dim)
    assert inv.shape == (a.head_dim // 2,)
    assert a.num_heads % a.num_kv_heads == 0
