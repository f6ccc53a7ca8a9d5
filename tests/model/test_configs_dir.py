"""Every configs/ entry names a registered architecture and builds its model arguments and
rotary tables (the shapes the dummy-weight benchmarks run), without allocating the model."""

from __future__ import annotations

import os

import pytest

from fulcrum.kv_cache.sliding_window import FULL, SLIDING
from fulcrum.model.gemma import GemmaArgs, _rope_params, _RopeView
from fulcrum.model.layers.rotary import compute_inv_freq
from fulcrum.model.llama import ModelArgs
from fulcrum.model.loader.hf_config import load_hf_config
from fulcrum.model.loader.resolve import CONFIGS_DIR
from fulcrum.model.registry import get_model_cls

ENTRIES = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))


def test_new_entries_present():
    assert {
        "qwen3-8b.json",
        "phi-3-mini.json",
        "gemma-3-12b.json",
        "mixtral-8x7b.json",
        "qwen3-30b-a3b.json",
    } <= set(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES)
def test_config_entry_builds_model_args(entry):
    cfg = load_hf_config(os.path.join(CONFIGS_DIR, entry))
    get_model_cls(cfg.architectures[0])
    if cfg.architectures[0].startswith("Gemma"):
        a = GemmaArgs.from_gemma(cfg, max_position=4096)
        for t in set(a.layer_types):
            inv, _ = compute_inv_freq(_RopeView(cfg, _rope_params(cfg, t, a.gemma3)), a.head_dim)
            assert inv.shape == (a.head_dim // 2,)
    else:
        a = ModelArgs.from_hf(cfg, max_position=2047)
        inv, _ = compute_inv_freq(cfg, a.head_dim)
        assert inv.shape == (a.head_dim // 2,)
    assert a.num_heads % a.num_kv_heads == 0


def test_gemma3_12b_layer_pattern_and_rotary():
    cfg = load_hf_config(os.path.join(CONFIGS_DIR, "gemma-3-12b.json"))
    a = GemmaArgs.from_gemma(cfg, max_position=4096)
    assert a.layer_types[:6] == (SLIDING,) * 5 + (FULL,) and len(a.layer_types) == 48
    assert a.sliding_window == 1024 and a.query_pre_attn_scalar == 256.0
    local, _ = compute_inv_freq(_RopeView(cfg, _rope_params(cfg, SLIDING, True)), 256)
    glob, _ = compute_inv_freq(_RopeView(cfg, _rope_params(cfg, FULL, True)), 256)
    assert abs(local[1] - 10000.0 ** (-2 / 256)) < 1e-9  # the local base, unscaled
    assert abs(glob[1] - 1e6 ** (-2 / 256) / 8.0) < 1e-12  # the global base, linear / 8


def test_smollm3_3b_leaves_rotary_out_of_every_fourth_layer():
    from fulcrum.kv_cache.sliding_window import layer_types, rope_layers

    cfg = load_hf_config(os.path.join(CONFIGS_DIR, "smollm3-3b.json"))
    flags = rope_layers(cfg)
    assert len(flags) == 36 and [i for i, f in enumerate(flags) if not f] == list(range(3, 36, 4))
    assert set(layer_types(cfg)) == {FULL}
