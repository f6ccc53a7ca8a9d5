"""The reasoning parsers: whole outputs split into (reasoning, content), and any chunking of the
same output streamed gives the same two texts."""

from __future__ import annotations

import random

import pytest

from fulcrum.entrypoints.openai.reasoning import ReasoningStream, get_reasoning_parser

CASES = [
    # (output, deepseek_r1, qwen3)
    ("<think>plan a</think>Answer", ("plan a", "Answer"), ("plan a", "Answer")),
    ("plan a</think>\n\nAnswer", ("plan a", "\n\nAnswer"), (None, "plan a</think>\n\nAnswer")),
    ("still thinking", ("still thinking", ""), (None, "still thinking")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    ("<thin", ("<thin", ""), (None, "<thin")),
    ("Answer with </thin tail", ("Answer with </thin tail", ""), (None, "Answer with </thin tail")),
    ("<think></think>", ("", ""), ("", "")),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_whole_and_streamed_agree(name: str) -> None:
    parser = get_reasoning_parser(name)
    rng = random.Random(0)
    for text, r1, q3 in CASES:
        want = r1 if name == "deepseek_r1" else q3
        assert parser.split(text) == want, text
        for _ in range(20):  # random chunkings, one-character chunks included
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(6))))
            st, reasoning, content = ReasoningStream(parser), "", ""
            for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
                r, c = st.feed(text[a:b])
                reasoning, content = reasoning + r, content + c
            r, c = st.finish()
            reasoning, content = reasoning + r, content + c
            assert (reasoning or None if want[0] is None else reasoning, content) == want, (text, cuts)


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("o1")
