"""Streamed tool calls: fed in arbitrary pieces, every format's deltas assemble into exactly the
calls the whole-text parse finds (names and argument strings), in OpenAI's order (id and name
first, then argument fragments), with the arguments sent while the model is still writing them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from fulcrum.entrypoints.openai.tool_calls import ToolCalls, ToolStream
from fulcrum.entrypoints.openai.tool_parsers import get_parser
from fulcrum.entrypoints.openai.tool_parsers.scanner import CallScanner

ARGS_A = '{"city": "Paris, \\"FR\\" {x}", "days": [1, 2, {"n": null}], "ok": true}'
ARGS_B = '{"tz":"UTC"}'
TEXTS = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": '
        + ARGS_A
        + "}\n</tool_call>\n"
        '<tool_call>\n{"arguments": ' + ARGS_B + ', "name": "time"}\n</tool_call>'
    ),
    "llama3_json": (
        '{"name": "weather", "parameters": '
        + ARGS_A
        + '}; {"name": "time", "parameters": '
        + ARGS_B
        + "}"
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "weather", "arguments": ' + ARGS_A + '}, {"name": "time", '
        '"arguments": ' + ARGS_B + "}]"
    ),
    "forced": (
        '[{"name": "weather", "parameters": '
        + ARGS_A
        + '}, {"name": "time", "parameters": '
        + ARGS_B
        + "}]"
    ),
}


def _tools(fmt: str) -> ToolCalls:
    return ToolCalls(None, forced=True) if fmt == "forced" else ToolCalls(get_parser(fmt))


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        out.append(text[i : i + n])
        i += n
    return out


def stream(tools: ToolCalls, pieces: list[str]) -> tuple[str, dict[int, dict[str, Any]], list]:
    """Content, the assembled calls by index, and every delta in order with its piece number."""
    st = ToolStream(tools)
    content, calls, log = "", {}, []
    for n, piece in enumerate(pieces):
        text, deltas = st.feed(piece)
        content += text
        for d in deltas:
            log.append((n, d))
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    content += st.finish()
    return content, calls, log


@pytest.mark.parametrize("fmt", list(TEXTS))
@pytest.mark.parametrize("seed", range(6))
def test_stream_equals_whole(fmt: str, seed: int) -> None:
    text = TEXTS[fmt]
    tools = _tools(fmt)
    msg, has = tools.message(text)
    assert has and [c["function"]["name"] for c in msg["tool_calls"]] == ["weather", "time"]
    whole = [c["function"]["arguments"] for c in msg["tool_calls"]]
    assert json.loads(whole[0]) == json.loads(ARGS_A) and whole[1] == ARGS_B
    pieces = _pieces(text, random.Random(seed)) if seed else list(text)
    content, calls, log = stream(tools, pieces)
    assert content.strip() == (msg["content"] or "")
    assert [calls[k]["name"] for k in sorted(calls)] == ["weather", "time"]
    assert [calls[k]["arguments"] for k in sorted(calls)] == whole
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    # Incremental: the first call's arguments were sent in several pieces, before the text ended.
    frags = [n for n, d in log if d["index"] == 0 and d["function"]["arguments"]]
    assert len(frags) > 3 and frags[0] < len(pieces) // 2


def test_name_after_arguments_is_sent_then() -> None:
    """Hermes' second call above names itself after its arguments: nothing of it goes out
    before the name, then its arguments so far go in the same delta."""
    _, _, log = stream(_tools("hermes"), list(TEXTS["hermes"]))
    second = [d for _, d in log if d["index"] == 1]
    assert second[0]["function"] == {"name": "time", "arguments": ARGS_B} and len(second) == 1


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", "Just text, no calls {here}."),
        ("hermes", "<tool_call>{not json</tool_call>"),
        ("llama3_json", 'Hello {"name": "f", "parameters": {}}'),
        ("mistral", "[TOOL_CALLS] [{]"),
    ],
)
def test_plain_content_streams_as_content(fmt: str, text: str) -> None:
    tools = _tools(fmt)
    content, calls, _ = stream(tools, list(text))
    assert calls == {} and content == text
    assert tools.message(text) == ({"role": "assistant", "content": text}, False)


def test_cut_call_sends_what_is_known() -> None:
    """Output cut by max_tokens mid-arguments: the name and a prefix of the arguments went out."""
    text = TEXTS["hermes"]
    cut = text[: text.index('"days"')]
    _, calls, _ = stream(_tools("hermes"), list(cut))
    assert calls[0]["name"] == "weather" and ARGS_A.startswith(calls[0]["arguments"])
    assert _tools("hermes").message(cut)[1] is False  # whole: not a call


def test_scanner_values() -> None:
    import re

    sc = CallScanner(re.compile(r"\s*"), ("arguments",))
    sc.feed('{"name": "f", "arguments": "{\\"a\\": 1}", "x": 3} {"name": "g", "n": -1.5}')
    assert [c.name for c in sc.calls] == ["f", "g"] and all(c.complete for c in sc.calls)
    assert sc.streamable_arguments(sc.calls[0]) == '{"a": 1}'  # a JSON string: its contents
    assert sc.streamable_arguments(sc.calls[1]) == "{}"  # no arguments
    sc2 = CallScanner(re.compile(r"\s*"), ("arguments",))
    sc2.feed('junk {"name": "f"}')
    assert sc2.calls == [] and sc2.stopped  # the gap before the object is not allowed
