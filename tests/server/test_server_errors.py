"""Every error path: OpenAI body, right status (400 never 422/500), through client and raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from srv_helpers import MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL, Server

MSG = [{"role": "user", "content": "hi"}]


def assert_error(status: int, body: bytes, expected: int, param: str | None = "") -> dict[str, Any]:
    assert status == expected, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "":
        assert err["param"] == param, err
    return err


BAD_CHAT = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"max_completion_tokens": MAX_MODEL_LEN * 4}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"priority": "high"}, "priority"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"priority": 2**64}, "priority"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids[1]"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "tool"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [*MSG, {"role": "assistant"}]}, "messages[1].content"),
    ({"max_tokens": True}, "max_tokens"),
    ({"n": True}, "n"),
    ({"temperature": False}, "temperature"),
    ({"continue_final_message": 0}, "continue_final_message"),
    ({"stream": "yes"}, "stream"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"top_k": -5}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tool_choice": "auto"}, "tool_choice"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_chat_validation_is_400(server: Server, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, **extra}
    status, data, _ = server.request("POST", "/v1/chat/completions", body)
    err = assert_error(status, data, 400, param)
    assert err["type"] == "invalid_request_error"


BAD_COMPLETION = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, ""),
    ({"prompt": [1, -3]}, "prompt[1]"),
    ({"prompt": [[False]]}, "prompt[0][0]"),
    ({"prompt": [True, 2]}, "prompt[0]"),
    ({"max_tokens": True}, "max_tokens"),
    ({"echo": 1}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo (scoring the prompt)
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"prompt": [10**7]}, "prompt"),
    ({"logit_bias": {str(10**7): 1}}, "logit_bias"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"prompt": 5}, ""),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": ["a"] * 300}, "prompt"),
    ({"prompt": ["a"] * 256, "n": 16}, "n"),  # 4,096 sequences: more than the server holds
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_COMPLETION)
def test_completion_validation_is_400(
    server: Server, extra: dict[str, Any], param: str | None
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}
    status, data, _ = server.request("POST", "/v1/completions", body)
    assert_error(status, data, 400, param)


def test_prompt_over_context_says_limit_and_counts(server: Server, client: Any) -> None:
    prompt = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    msg = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert str(MAX_MODEL_LEN) in msg and "input tokens" in msg
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=MAX_MODEL_LEN)
    assert f"{MAX_MODEL_LEN} tokens" in str(e.value) and "in the messages" in str(e.value)


def test_malformed_bodies_are_400(server: Server) -> None:
    for raw in [b"{not json", b"[]", b"null", b'"text"', b"", b'{"messages": "hi"}']:
        status, data, _ = server.request("POST", "/v1/chat/completions", raw=raw)
        assert_error(status, data, 400)
    status, data, _ = server.request(
        "POST", "/v1/completions", raw=b'{"prompt": "x"', headers={"Content-Type": "text/plain"}
    )
    assert_error(status, data, 400)


def test_lone_surrogates_are_400(server: Server) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "a\ud800", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}),
        ("/tokenize", {"prompt": "\ud800"}),
    ]:
        status, data, _ = server.request("POST", path, body)
        assert_error(status, data, 400)


def test_client_bad_request(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=5)
    assert e.value.body["param"] == "temperature"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{MODEL}", None),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MSG}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/v1/nonexistent", None),
    ],
)
def test_api_key_required(server: Server, method: str, path: str, body: Any) -> None:
    for key in (None, "wrong-key"):
        status, data, headers = server.request(method, path, body, key=key)
        err = assert_error(status, data, 401)
        assert err["code"] == "invalid_api_key"


def test_api_key_via_client_and_open_probes(server: Server) -> None:
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for path in ("/health", "/ready", "/version"):
        assert server.request("GET", path, key=None)[0] == 200, path
    # /metrics and the API's description follow the key (no --public-endpoints here).
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        assert_error(*server.request("GET", path, key=None)[:2], 401)
        assert server.request("GET", path)[0] == 200, path


def test_unknown_model_and_route_are_404(server: Server, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MSG)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    status, data, _ = server.request("GET", "/v1/nope")
    assert_error(status, data, 404)
    status, data, _ = server.request("POST", "/tokenize", {"model": "gpt-17", "prompt": "x"})
    assert_error(status, data, 404, "model")


def test_body_over_limit_is_413(server: Server, client: Any) -> None:
    big = {"model": MODEL, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    status, data, _ = server.request("POST", "/v1/completions", big)
    err = assert_error(status, data, 413)
    assert str(MAX_REQUEST_BYTES) in err["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="y" * (MAX_REQUEST_BYTES + 10))
    assert e.value.status_code == 413


def test_detokenize_out_of_vocab_is_400(server: Server) -> None:
    status, data, _ = server.request("POST", "/detokenize", {"tokens": [1, 10**8]})
    assert_error(status, data, 400, "tokens")
    status, data, _ = server.request("POST", "/tokenize", {})
    assert_error(status, data, 400)


def test_message_shape_errors_name_the_field(server: Server) -> None:
    status, data, _ = server.request(
        "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool"}]}
    )
    err = assert_error(status, data, 400, "messages[0].content")
    assert "messages[0].content" in err["message"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, image]}]}
    status, data, _ = server.request("POST", "/v1/chat/completions", body)
    err = assert_error(status, data, 400, "messages[0].content[1]")
    assert "image inputs are not supported by this model" in err["message"]
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body = {"messages": [{"role": "user", "content": [audio]}]}
    status, data, _ = server.request("POST", "/v1/chat/completions", body)
    assert "audio inputs are not supported" in assert_error(status, data, 400)["message"]


def test_tool_history_is_accepted(server: Server) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "What is f?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    status, out = server.json(
        "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2}
    )
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")


def test_detokenize_and_tokenize_are_strict(server: Server) -> None:
    status, data, _ = server.request("POST", "/detokenize", {"tokens": [False]})
    assert_error(status, data, 400, "tokens[0]")
    status, data, _ = server.request("POST", "/detokenize", {"tokens": [-1]})
    assert_error(status, data, 400, "tokens[0]")
    status, data, _ = server.request("POST", "/tokenize", {"messages": []})
    assert_error(status, data, 400, "messages")


def test_body_parse_errors_say_why(server: Server) -> None:
    status, data, _ = server.request("POST", "/v1/completions", raw=b'{"prompt": "\xff\xfe"}')
    assert "not valid UTF-8" in assert_error(status, data, 400)["message"]
    deep = b"[" * 10_000 + b"]" * 10_000
    status, data, _ = server.request("POST", "/v1/completions", raw=b'{"prompt": ' + deep + b"}")
    assert "nesting too deep" in assert_error(status, data, 400)["message"]
    assert server.request("GET", "/health", key=None)[0] == 200


def test_health_and_metrics_bodies_match_the_schema(server: Server) -> None:
    # the shared server has a key, which /openapi.json and /metrics follow; /health never needs it
    status, schema = server.json("GET", "/openapi.json")
    assert status == 200
    paths = schema["paths"]
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    status, body, headers = server.request("GET", "/health", key=None)
    assert status == 200 and body == b""
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    status, body, headers = server.request("GET", "/metrics")
    assert headers["content-type"].startswith("text/plain") and b"# TYPE" in body
    assert "422" not in json.dumps(schema)
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 16 and props["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert props["stop"]["anyOf"][1]["maxItems"] == 16
    assert schema["components"]["schemas"]["TokenizeRequest"]["properties"]["messages"][
        "anyOf"
    ][0]["minItems"] == 1
    assert props["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    # The token id bound is the served model's vocabulary: the largest id the schema allows
    # detokenizes, the next one is refused.
    tokens = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    top = tokens["items"]["maximum"]
    assert server.request("POST", "/detokenize", {"tokens": [top]})[0] == 200
    assert server.request("POST", "/detokenize", {"tokens": [top + 1]})[0] == 400


def test_deep_json_near_the_parser_limit_is_never_500(server: Server) -> None:
    # Around the depth where the JSON parser gives up: what it accepts, the request's checks
    # (which walk free-form objects) must also get through.
    for depth in range(930, 980, 5):
        nested = b"[" * depth + b"]" * depth
        raw = (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
            b'"chat_template_kwargs": {"a": %s}}' % nested
        )
        status, data, _ = server.request("POST", "/v1/chat/completions", raw=raw)
        assert status in (200, 400), (depth, data[:300])
