"""Shared by the speculative-decoding tests: prompts the proposers find matches in, the law
test's chi-square check, the engine's idle-state check, and the suffix trie that suffix
decoding's array walks must equal."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence

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


# -- the suffix trie, written from suffix decoding's description (``spec_decode/suffix.py``) ----


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Every suffix of its texts cut at ``max_depth`` tokens, a count per node."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self._open: list[tuple[_Node, int]] = []  # (node, depth) of suffixes still growing

    def append(self, token: int) -> None:
        """Extend the text by one token (every open suffix, plus the one starting here)."""
        grown: list[tuple[_Node, int]] = []
        for node, depth in [*self._open, (self.root, 0)]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            if depth + 1 < self.max_depth:
                grown.append((child, depth + 1))
        self._open = grown

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def end_text(self) -> None:
        """The next ``append`` starts an unrelated text (patterns never span two texts)."""
        self._open = []

    def remove_text(self, tokens: Sequence[int]) -> None:
        """Undo ``extend(tokens)`` + ``end_text()`` of a whole text: its counts go, and nodes
        no text reaches any more are dropped."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def propose(
        self, context: Sequence[int], k: int, spec_factor: float, min_prob: float
    ) -> tuple[list[int], float]:
        """Guesses after ``context`` and their expected accepted count (sum of probabilities)."""
        n = len(context)
        for start in range(max(0, n - self.max_depth + 1), n):
            node: _Node | None = self.root
            for t in context[start:]:
                node = node.children.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is None or not node.children:
                continue
            length = min(k, max(1, int(spec_factor * (n - start))))
            out: list[int] = []
            prob, score = 1.0, 0.0
            while node.children and len(out) < length:
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / node.count
                if prob < min_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            if out:
                return out, score
        return [], 0.0
