"""Tool-call parsers, streamed tool-call assembly, the forced-call schema, and the matcher's
rollback (the grammar state after undoing k tokens equals the state before them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fulcrum.entrypoints.openai.tool_calls import ToolCalls, ToolStream
from fulcrum.entrypoints.openai.tool_parsers import get_parser, parser_for_template
from fulcrum.entrypoints.openai.tool_prompt import hermes_messages, tool_call_schema
from fulcrum.sampling_params import StructuredOutputsParams as SO
from fulcrum.structured.validate import validate_structured


def test_hermes() -> None:
    p = get_parser("hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json</tool_call>")[1] == []


def test_llama3_and_mistral() -> None:
    content, calls = get_parser("llama3_json").parse(
        '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}')
    assert content == "" and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": "y"}
    assert get_parser("llama3_json").parse("Hello {there}")[1] == []
    content, calls = get_parser("mistral").parse(
        'ok [TOOL_CALLS] [{"name": "f", "arguments": {"q": 2}}]')
    assert content == "ok" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": 2}
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_parser("nope")


def test_granite() -> None:
    p = get_parser("granite")
    content, calls = p.parse(
        '<|tool_call|>[{"name": "f", "arguments": {"city": "Oslo"}}, {"name": "g", "arguments": {}}]'
    )
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"city": "Oslo"}), ("g", {})]  # fmt: skip
    assert p.parse('Sure. <|tool_call|>[{"name": "f", "arguments": {"a": 1}}]')[0] == "Sure."
    assert p.parse('[{"name": "f", "arguments": {}}]')[1] == []  # no opening token: content
    st = ToolStream(ToolCalls(p))
    fed = [st.feed(d) for d in ["<|tool", '_call|>[{"name": "f", ', '"arguments": {"a": 2}}', "]"]]
    deltas = [d for _, ds in fed for d in ds]
    assert "".join(t for t, _ in fed) == "" and len(deltas) == 1
    assert deltas[0]["function"] == {"name": "f", "arguments": '{"a": 2}'}


def test_parser_for_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{- '<|tool_call|>' + tool_calls | tojson }}") == "granite"
    assert parser_for_template("<|python_tag|> ipython <|eot_id|>") == "llama3_json"
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for_template(None) == "hermes"


def test_stream_holds_back_the_call() -> None:
    st = ToolStream(ToolCalls(get_parser("hermes")))
    fed = [st.feed(d) for d in ["Sure", ". <tool", '_call>{"name": "f", ', '"arguments": {}}']]
    assert "".join(t for t, _ in fed) == "Sure."  # the space before the call is dropped
    deltas = [d for _, ds in fed for d in ds]
    assert len(deltas) == 1 and deltas[0]["id"] and deltas[0]["index"] == 0
    assert deltas[0]["function"] == {"name": "f", "arguments": "{}"}
    assert st.finish() == "" and st.has_calls
    plain = ToolStream(ToolCalls(get_parser("hermes")))
    assert plain.feed("a <tool") == ("a", [])  # may be the opening text: held, with the space
    assert plain.feed("s>") == (" <tools>", [])
    assert plain.feed(" ") == ("", [])
    assert plain.finish() == " " and not plain.has_calls
    broken = ToolStream(ToolCalls(get_parser("hermes")))
    assert broken.feed("x <tool_call>{not json") == ("x", [])
    assert broken.finish() == " <tool_call>{not json"  # no call was sent: it was content


def test_tool_without_parameters_takes_none() -> None:
    import jsonschema

    schema = tool_call_schema([{"type": "function", "function": {"name": "ping"}}], "ping", False)
    jsonschema.validate([{"name": "ping", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {"type": "function"}}], schema)


def test_forced_schema_validates_only_calls_of_the_tools() -> None:
    import jsonschema

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "g"}}]
    one = tool_call_schema(tools, "f", True)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}], one)
    many = tool_call_schema(tools, None, True)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}], many)
    validate_structured(SO(json=many))
    forced = ToolCalls(None, forced=True)
    msg, has = forced.message('[{"name": "f", "parameters": {"a": 1}}]')
    assert has and msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f"


def test_hermes_messages_render_tool_turns() -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    out = hermes_messages(msgs, [{"type": "function", "function": {"name": "f"}}])
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


@pytest.mark.parametrize(("params", "match"), [
    (SO(json={"type": "nope"}), "structured_outputs.json: invalid JSON schema"),
    (SO(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (SO(json="{bad"), "not valid JSON"),
    (SO(regex="[a-"), "structured_outputs.regex"),
    (SO(grammar="root ::= missing"), "structured_outputs.grammar"),
])
def test_validation_names_the_field(params: SO, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_structured(params)


def test_params_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])


def test_matcher_rollback(smollm_tokenizer) -> None:
    from fulcrum.structured.xgrammar_backend import XgrammarBackend

    tok = smollm_tokenizer
    backend = XgrammarBackend(tok, len(tok), [tok.eos_token_id])
    m = backend.compile(SO(json={"type": "object", "properties": {"k": {"type": "integer"}},
                                 "required": ["k"]})).new_matcher()
    ids = tok.encode('{"k": 12', add_special_tokens=False)
    mask = backend.allocate_bitmask(2)
    m.fill_bitmask(mask, 0)
    for t in ids:
        assert m.accept_token(t)
    assert not m.accept_token(tok.encode("x", add_special_tokens=False)[0])  # not allowed: "k" is int
    m.rollback(len(ids))
    m.fill_bitmask(mask, 1)
    assert np.array_equal(mask[0], mask[1])
    assert not (mask[0] == -1).all()  # the start allows only some tokens


def test_batched_fill_equals_row_by_row(smollm_tokenizer) -> None:
    """The threaded fill of a step's rows writes what each matcher writes alone, into the rows
    it is given (rows without a grammar stay all-allowed)."""
    from fulcrum.structured.xgrammar_backend import XgrammarBackend

    tok = smollm_tokenizer
    backend = XgrammarBackend(tok, len(tok) + 64, [tok.eos_token_id])  # padded vocabulary
    grammar = backend.compile(SO(json={"type": "object", "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}))
    prefixes = ["", '{"name": "a', '{"name": "ab", "n": 1', '{"name": "x", "n": ', "{", '{"n']
    matchers = []
    for text in prefixes * 2:  # 12 rows: past the threaded path's minimum
        m = grammar.new_matcher()
        for t in tok.encode(text, add_special_tokens=False):
            assert m.accept_token(t), text
        matchers.append(m)
    rows = [2 * i + 1 for i in range(len(matchers))]
    batched = backend.allocate_bitmask(2 * len(matchers) + 1)
    backend.fill_bitmasks(matchers, batched, rows)
    for m, row in zip(matchers, rows, strict=True):
        alone = backend.allocate_bitmask(1)
        m.fill_bitmask(alone, 0)
        assert np.array_equal(batched[row], alone[0])
        assert (batched[row - 1] == -1).all()
    assert len({batched[r].tobytes() for r in rows}) == len(prefixes)
