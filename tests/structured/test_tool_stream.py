"""Streamed tool calls: fed in arbitrary pieces, every format's deltas assemble into exactly the
calls the whole-text parse finds (names and argument strings), each call sent whole as soon as its
object closes; output whose calls do not count (malformed, unknown, cut) is the same content
streamed or not."""

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


def _tools(fmt: str, names: frozenset[str] | None = None) -> ToolCalls:
    if fmt == "forced":
        return ToolCalls(None, forced=True)
    return ToolCalls(get_parser(fmt), names=names)


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
    assert content == (msg["content"] or "")
    assert [calls[k]["name"] for k in sorted(calls)] == ["weather", "time"]
    assert [calls[k]["arguments"] for k in sorted(calls)] == whole
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    # Each call in one delta, sent at the piece that closed its object: the first one before the
    # second call's text began.
    assert [d["index"] for _, d in log] == [0, 1]
    fed = "".join(pieces[: log[0][0] + 1])
    assert fed.count(ARGS_A) == 1 and ARGS_B not in fed


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


def test_cut_call_is_content() -> None:
    """Output cut by max_tokens mid-arguments: no call goes out; the text is the content, as in
    the whole response."""
    text = TEXTS["hermes"]
    cut = text[: text.index('"days"')]
    content, calls, _ = stream(_tools("hermes"), list(cut))
    assert calls == {} and content == cut
    assert _tools("hermes").message(cut) == ({"role": "assistant", "content": cut}, False)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not a tool
        '<tool_call>\n{"name": "weather", "arguments": [1, 2]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "weather", "arguments": "not json"}\n</tool_call>',
        'Sure! <tool_call>\n{"name": "weather", "arguments": {"city": "Par',  # cut
    ],
)
def test_calls_that_do_not_count_are_content(text: str) -> None:
    tools = _tools("hermes", frozenset({"weather", "time"}))
    for seed in range(3):
        pieces = _pieces(text, random.Random(seed)) if seed else list(text)
        content, calls, _ = stream(tools, pieces)
        assert calls == {} and content == text
    assert tools.message(text) == ({"role": "assistant", "content": text}, False)


def test_calls_end_at_the_first_that_does_not_count() -> None:
    good = '{"name": "weather", "arguments": {"city": "Oslo"}}'
    text = f"Checking.  \n<tool_call>\n{good}\n</tool_call>\n<tool_call>\n{{\"name\": \"time\", " \
        '"arguments": {tz: 1}}\n</tool_call>'
    tools = _tools("hermes", frozenset({"weather", "time"}))
    msg, has = tools.message(text)
    assert has and msg["content"] == "Checking." and len(msg["tool_calls"]) == 1
    content, calls, _ = stream(tools, list(text))
    assert content == "Checking." and len(calls) == 1
    assert calls[0]["arguments"] == msg["tool_calls"][0]["function"]["arguments"]


def test_forced_cut_output_is_not_content() -> None:
    """tool_choice required / named, cut by max_tokens: the call array's JSON never leaks into
    the content."""
    cut = '[{"name": "weather", "parameters": {"city": "Os'
    content, calls, _ = stream(_tools("forced"), list(cut))
    assert content == "" and calls == {}
    assert _tools("forced").message(cut) == ({"role": "assistant", "content": None}, False)


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
