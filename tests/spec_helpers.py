"""Shared by the speculative-decoding tests: prompts the proposers find matches in, the law
test's chi-square check, and the engine's idle-state check."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch


def spec_prompts(seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (the proposers find matches) and random ones, tiny-model vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        unit = [rng.randrange(3, 320) for _ in range(rng.randrange(3, 7))]
        out.append((unit * 6)[: rng.randrange(12, 30)])
    out += [[rng.randrange(3, 320) for _ in range(rng.randrange(5, 25))] for _ in range(3)]
    return out


def toks(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def check_idle(llm) -> None:
    kv = llm.core.scheduler.kv
    kv.check_integrity()
    assert kv.num_available == kv.num_blocks


def chi2_ok(counts: np.ndarray, probs: np.ndarray, n: int) -> bool:
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token of probability 0 was emitted"
    stat = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    return stat < dof + 6 * (2 * dof) ** 0.5  # far in the tail only if the law is wrong


def make_drafts(target: str, root) -> dict[str, str]:
    """Draft models for the tiny Llama ``target``: itself (every guess kept), a copy with noised
    weights (some kept) and a smaller random Llama with its vocabulary (almost none)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    noisy = root / "noisy"
    noisy.mkdir()
    g = torch.Generator().manual_seed(5)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(target)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(target, f)))
    noised = {n: w + 0.6 * w.std() * torch.randn(w.shape, generator=g) for n, w in weights.items()}
    save_file(noised, str(noisy / "model.safetensors"))
    with open(os.path.join(target, "config.json")) as fh:
        (noisy / "config.json").write_text(json.dumps(json.load(fh)))
    cfg = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "small"))
    return {"self": target, "noisy": str(noisy), "small": str(root / "small")}


def draft_spec(draft: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
