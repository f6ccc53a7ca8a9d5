"""Structured output and tool calling through the real server and the official client."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "Tell me about a person, as JSON."}]


def chat(client: Any, **kw: Any) -> Any:
    kw.setdefault("model", client.models.list().data[0].id)
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(**kw)


def test_response_format_json_schema(client: Any) -> None:
    for temperature in (0.0, 1.0):
        r = chat(client, temperature=temperature, seed=3, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_response_format_json_object(client: Any) -> None:
    r = chat(client, response_format={"type": "json_object"}, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_parse_with_pydantic(client: Any) -> None:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    r = client.chat.completions.parse(
        model=client.models.list().data[0].id, messages=USER, response_format=Person,
        max_tokens=48, temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, Person)


def test_extra_body_regex_choice_grammar_on_completions(client: Any) -> None:
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="My phone number is", max_tokens=12,
                                  temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["blue", "green"]})
    assert r.choices[0].text in ("blue", "green")
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = chat(client, max_tokens=20, extra_body={"structured_outputs": {"grammar": ebnf}})
    text = r.choices[0].message.content
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) or (
        r.choices[0].finish_reason == "length" and text.startswith("(")
    )


def test_length_gives_a_prefix(client: Any) -> None:
    r = chat(client, max_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")


BAD_TOOL = {"type": "function", "function": {"name": "bad", "parameters": {"type": 5}}}
# Valid, but "uniqueItems" is not enforced by the grammar: refused where calls are forced only.
UNENFORCEABLE = {"type": "function", "function": {"name": "u", "parameters": {
    "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format"),
        ({"structured_outputs": {"json": {"type": "integer", "multipleOf": 3}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, BAD_TOOL], "tool_choice": "auto"}, "tools[1].function.parameters"),
        ({"tools": [BAD_TOOL], "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [UNENFORCEABLE], "tool_choice": "required"}, "tools[0].function.parameters"),
    ],
)
def test_bad_constraints_are_400(server: Any, body: dict[str, Any], param: str) -> None:
    status, resp = server.json("POST", "/v1/chat/completions", {"messages": USER, **body})
    assert status == 400, resp
    assert resp["error"]["param"] == param, resp
    assert "/project/" not in resp["error"]["message"]  # no grammar library internals



def _args(call: Any, schema: dict[str, Any]) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_tool_choice_named_and_required(client: Any) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = chat(client, messages=msgs, tools=[WEATHER, TIME],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
    _args(c.message.tool_calls[0], WEATHER["function"]["parameters"])
    r = chat(client, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80,
             parallel_tool_calls=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for t in c.message.tool_calls:
        _args(t, by_name[t.function.name]["function"]["parameters"])


def test_tool_call_streaming(client: Any) -> None:
    msgs = [{"role": "user", "content": "What time is it in UTC?"}]
    stream = chat(client, messages=msgs, tools=[WEATHER, TIME], stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    cur["id"] = tc.id
                if tc.function and tc.function.name:
                    cur["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    cur["arguments"] += tc.function.arguments
    assert reasons[-1] == "tool_calls"
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["function"]["parameters"])


def test_multi_turn_with_tool_result(client: Any) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = chat(client, messages=msgs, tools=[WEATHER], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    msgs.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'})
    r = chat(client, messages=msgs, tools=[WEATHER], max_tokens=24)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls


def _assemble(stream: Any) -> tuple[str, list[tuple[str, str, str]], str | None, int]:
    """A streamed choice as (content, [(id, name, arguments)], finish_reason, argument deltas),
    checking OpenAI's order: a call's id and name come first, in one delta, once."""
    content, calls, reason, frags = "", {}, None, 0
    for chunk in stream:
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name, tc
                if tc.function.arguments:
                    calls[tc.index][2] += tc.function.arguments
                    frags += 1
    return content, [tuple(calls[k]) for k in sorted(calls)], reason, frags


def _streamed_and_whole(client: Any, **kw: Any) -> tuple[Any, tuple]:
    whole = chat(client, **kw).choices[0]
    return whole, _assemble(chat(client, stream=True, **kw))


def test_streamed_forced_parallel_calls_equal_whole(client: Any) -> None:
    msgs = [{"role": "user", "content": "Weather in Paris and the time in UTC, please."}]
    whole, (content, calls, reason, frags) = _streamed_and_whole(
        client, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=True, max_tokens=80)
    assert whole.finish_reason == reason == "tool_calls"
    expect = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert [(n, a) for _, n, a in calls] == expect and content == ""
    assert all(i.startswith("call_") for i, _, _ in calls)
    assert frags == len(calls)  # each call whole, in one delta once its object closed


def test_streamed_auto_parallel_calls_equal_whole(client: Any) -> None:
    """``auto`` with the Hermes parser; a regex makes the model write two calls after a sentence,
    so the parser's streaming path runs on real output."""
    regex = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", '
             r'"arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>')
    msgs = [{"role": "user", "content": "Weather in Paris and the time in UTC, please."}]
    whole, (content, calls, reason, frags) = _streamed_and_whole(
        client, messages=msgs, tools=[WEATHER, TIME], max_tokens=96,
        extra_body={"structured_outputs": {"regex": regex}})
    assert whole.finish_reason == reason == "tool_calls", whole
    assert whole.message.content == content.strip() == "Checking."
    expect = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert [n for n, _ in expect] == ["get_weather", "get_time"]
    assert [(n, a) for _, n, a in calls] == expect
    assert frags == len(calls)
    for (_, args), tool in zip(expect, (WEATHER, TIME), strict=True):
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])
