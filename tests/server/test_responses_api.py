"""``POST /v1/responses`` through the official client's ``client.responses``: the same tokens as
the chat API for the same conversation, OpenAI's output items and stream events, JSON schema and
tool calls (a conversation with function-call outputs sent back), reasoning items, and 400s that
name the Responses API's own fields."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from srv_helpers import MODEL, Server

Q = "What is the capital of France?"


def _chat_text(client: Any, messages: list[dict[str, Any]], n: int) -> tuple[str, Any]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=n,
                                       temperature=0)  # fmt: skip
    return r.choices[0].message.content, r


def test_same_answer_as_chat_whole_and_streamed(client: Any) -> None:
    text, chat = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": Q}], 12)  # fmt: skip
    kw: dict[str, Any] = dict(model=MODEL, instructions="Be brief.", max_output_tokens=12,
                              temperature=0)  # fmt: skip
    r = client.responses.create(input=Q, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if r.status == "incomplete":  # the message item says so too
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == r.status
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    # the input as items: the SDK's easy form and a typed message with input_text parts
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": Q}]}]
    assert client.responses.create(input=items, **kw).output_text == text
    events = list(client.responses.create(input=[{"role": "user", "content": Q}], stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == r.usage.output_tokens
    assert final.output[0].status == r.status


def test_json_schema_and_logprobs(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input=Q, max_output_tokens=40, temperature=0, top_logprobs=2,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    lps = r.output[0].content[0].logprobs
    assert "".join(lp.token for lp in lps).startswith(r.output_text)  # the EOS entry may follow
    assert all(len(lp.top_logprobs) == 2 for lp in lps)


def test_function_calls_and_their_outputs(client: Any) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string",
                             "maxLength": 10}}, "required": ["city"]}}]  # fmt: skip
    kw: dict[str, Any] = dict(model=MODEL, tools=tools, tool_choice="required",
                              max_output_tokens=60, temperature=0)  # fmt: skip
    r = client.responses.create(input="Weather in Paris?", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = list(client.responses.create(input="Weather in Paris?", stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == [
        (c.name, c.arguments) for c in calls]  # fmt: skip
    # the call and its output sent back: the model answers in text
    follow = client.responses.create(
        model=MODEL, tools=tools, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21 C"}],
    )  # fmt: skip
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


def test_reasoning_item(client: Any) -> None:
    """The shared server runs --reasoning-parser qwen3; a regex forces a thinking output."""
    regex = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>The answer is [0-9]\."
    kw: dict[str, Any] = dict(model=MODEL, input="What is two plus two?", max_output_tokens=40,
                              temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought and "think>" not in thought and r.output_text.startswith("The answer is ")
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "background": True}, "background"),
        ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": []}, "input"),
        ({"input": "Hi", "temperature": 3}, "temperature"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_input_names_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    status, got = server.json("POST", "/v1/responses", {"model": MODEL, **body})
    assert status == 400, got
    err = got["error"]
    assert (err["param"] or "").startswith(param) or param in err["message"], err
    assert "messages" not in err["message"]  # the chat API's names stay inside
