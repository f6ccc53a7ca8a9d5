"""The thinking gate: a reasoning model's thinking is free, the grammar constrains the answer.
Its phases, rollback and bitmask against a recording grammar; where the server starts the
grammar (the prompt's last marker); which tokenizers have single-token markers."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.entrypoints.openai.reasoning import get_reasoning_parser, marker_ids
from fulcrum.sampling_params import StructuredOutputsParams, ThinkingGate
from fulcrum.structured.backend import GrammarMatcher
from fulcrum.structured.thinking import GatedMatcher

START, END = 7, 9
DIGITS = {40, 41, 42}  # the grammar: three of these, then terminated


class Digits(GrammarMatcher):
    def __init__(self) -> None:
        self.taken: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id not in DIGITS or len(self.taken) == 3:
            return False
        self.taken.append(token_id)
        return True

    def rollback(self, k: int) -> None:
        del self.taken[len(self.taken) - k :]

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = 0
        for t in DIGITS:
            bitmask.view(np.uint32)[row, t >> 5] |= np.uint32(1 << (t & 31))

    def is_terminated(self) -> bool:
        return len(self.taken) == 3


def allowed(m: GrammarMatcher) -> set[int]:
    mask = np.zeros((2, 2), dtype=np.int32)
    m.fill_bitmask(mask, 1)
    bits = mask[1].view(np.uint32)
    return {t for t in range(64) if bits[t >> 5] >> (t & 31) & 1}


def test_thinking_then_answer() -> None:
    inner = Digits()
    m = GatedMatcher(inner, ThinkingGate(START, END, "thinking"))
    assert allowed(m) == set(range(64))  # thinking: free
    for t in (3, 40, START, 5):  # a digit or the opening marker while thinking: not the grammar's
        assert m.accept_token(t) and not m.is_terminated()
    assert m.accept_token(END) and inner.taken == []
    assert allowed(m) == DIGITS
    assert not m.accept_token(5) and inner.taken == []  # refused by the grammar
    for t in (40, 41, 42):
        assert m.accept_token(t)
    assert inner.taken == [40, 41, 42] and m.is_terminated()
    m.rollback(2)  # two answer tokens
    assert inner.taken == [40] and m.phase == "answer"
    m.rollback(1)  # the answer's first token: the grammar is back at its start
    assert inner.taken == [] and m.phase == "answer" and allowed(m) == DIGITS
    m.rollback(1)  # the end marker: thinking again
    assert m.phase == "thinking" and allowed(m) == set(range(64))
    assert m.accept_token(END) and m.accept_token(41) and inner.taken == [41]


def test_either_opens_or_answers() -> None:
    gate = ThinkingGate(START, END, "either")
    m = GatedMatcher(Digits(), gate)
    assert allowed(m) == DIGITS | {START}  # the grammar's first tokens, or the thinking
    assert m.accept_token(START) and m.phase == "thinking" and allowed(m) == set(range(64))
    m.rollback(1)
    assert m.phase == "either"
    inner = Digits()
    m = GatedMatcher(inner, gate)
    assert m.accept_token(41) and inner.taken == [41] and m.phase == "answer"
    assert allowed(m) == DIGITS  # the opening marker is no longer allowed
    m.rollback(1)
    assert inner.taken == [] and m.phase == "either" and allowed(m) == DIGITS | {START}


def test_the_gate_crosses_the_wire() -> None:
    import msgspec

    from fulcrum.protocol import WireSamplingParams, to_wire
    from fulcrum.sampling_params import SamplingParams

    so = StructuredOutputsParams(regex="[0-9]+", thinking=ThinkingGate(START, END, "either"))
    wire = to_wire(SamplingParams(structured_outputs=so), 8)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=WireSamplingParams)
    assert back.structured_outputs == so
    with pytest.raises(ValueError, match="structured_outputs.thinking.opens"):
        ThinkingGate(START, END, "later")


@pytest.mark.parametrize(
    ("name", "prompt", "opens"),
    [
        ("deepseek_r1", [1, 2], "thinking"),  # no marker: R1's output may begin inside
        ("qwen3", [1, 2], "either"),  # no marker: Qwen3's output may open with <think>
        ("qwen3", [1, START, 2], "thinking"),  # the template opened the thinking
        ("deepseek_r1", [1, START, 2, END, 3, START], "thinking"),
        ("qwen3", [1, START, END, 3], None),  # thinking switched off: the grammar from the start
        ("deepseek_r1", [START, 2, END], None),
    ],
)
def test_gate_from_the_prompt(name: str, prompt: list[int], opens: str | None) -> None:
    gate = get_reasoning_parser(name).gate((START, END), prompt)
    assert (gate.opens if gate else None) == opens


def test_marker_ids_need_single_tokens() -> None:
    from fulcrum.model.loader.default_model import load_default_tokenizer

    tok = load_default_tokenizer()
    assert marker_ids(tok) is None  # SmolLM2 spells <think> in several tokens
    tok.add_tokens(["<think>", "</think>"])
    ids = marker_ids(tok)
    assert ids is not None and tok.convert_ids_to_tokens(list(ids)) == ["<think>", "</think>"]
