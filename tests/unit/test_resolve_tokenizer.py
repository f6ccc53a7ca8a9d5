"""A dummy-weights config can borrow the embedded model's tokenizer (configs/*-smoltok.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulcrum.model.loader.resolve import CONFIGS_DIR, resolve_model_config


def test_smoltok_configs_use_the_embedded_tokenizer() -> None:
    for name in ("llama-3.1-8b-smoltok", "llama-3.3-70b-smoltok"):
        mc = resolve_model_config(name, load_format="dummy")
        assert mc.tokenizer_path is not None
        assert (Path(mc.tokenizer_path) / "tokenizer.json").is_file()
        assert mc.vocab_size == 49152
    big = json.loads(Path(CONFIGS_DIR, "llama-3.1-8b.json").read_text())
    small = json.loads(Path(CONFIGS_DIR, "llama-3.1-8b-smoltok.json").read_text())
    differ = {k for k in big if big[k] != small.get(k)}
    assert differ == {"vocab_size", "bos_token_id", "eos_token_id"}  # the same shapes otherwise


def test_named_tokenizer_errors(tmp_path: Path) -> None:
    cfg = json.loads(Path(CONFIGS_DIR, "llama-3.1-8b-smoltok.json").read_text())
    bad_name = tmp_path / "a.json"
    bad_name.write_text(json.dumps({**cfg, "fulcrum_tokenizer": "gpt2"}))
    with pytest.raises(ValueError, match="fulcrum_tokenizer.*'gpt2'"):
        resolve_model_config(str(bad_name), load_format="dummy")
    bad_vocab = tmp_path / "b.json"
    bad_vocab.write_text(json.dumps({**cfg, "vocab_size": 128256}))
    with pytest.raises(ValueError, match="vocab_size.*128256.*49152"):
        resolve_model_config(str(bad_vocab), load_format="dummy")
    # An explicit tokenizer wins over the config's choice.
    mc = resolve_model_config(str(bad_name), load_format="dummy", tokenizer=str(tmp_path))
    assert mc.tokenizer_path == str(tmp_path)
