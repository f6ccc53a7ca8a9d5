"""OpenAI semantics through the official client against the real server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from srv_helpers import ADAPTER, MAX_MODEL_LEN, MODEL, Server, make_adapter

MSG = [{"role": "user", "content": "Name three colors."}]


def stream_chat(client: Any, **kw: Any) -> tuple[dict[int, str], dict[int, list[str]], list[Any]]:
    """Texts per index, finish reasons per index, and all chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    chunks = list(client.chat.completions.create(**{"model": MODEL, **kw}, stream=True))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons, chunks


def test_models(server: Server, client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ADAPTER]  # the base model, then its adapter
    assert client.models.retrieve(MODEL).id == MODEL
    status, body = server.json("GET", "/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert body["data"][1]["parent"] == MODEL and body["data"][0]["parent"] is None


def test_lora_adapter_by_model_name(client: Any) -> None:
    """``--lora-modules``: a request naming the adapter runs it (chat, completions, streamed);
    the base model's cached prefix serves none of its prompts."""
    kw: dict[str, Any] = dict(messages=MSG, max_tokens=10, temperature=0)
    first = client.chat.completions.create(model=ADAPTER, **kw)
    base = client.chat.completions.create(model=MODEL, **kw)
    again = client.chat.completions.create(model=ADAPTER, **kw)  # after the base cached it
    assert first.model == ADAPTER and base.model == MODEL
    assert first.choices[0].message.content != base.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content
    texts, _, _ = stream_chat(client, model=ADAPTER, **kw)
    assert texts[0] == first.choices[0].message.content
    comp = client.completions.create(model=ADAPTER, prompt="The sky is", max_tokens=5, temperature=0)
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert comp.choices[0].text != plain.choices[0].text


def test_lora_adapter_loaded_and_unloaded_while_serving(server: Server, client: Any, tmp_path) -> None:
    """``--allow-runtime-lora-updates``: POST /v1/load_lora_adapter serves a PEFT directory under
    a new model name (listed by /v1/models, answering as the same weights do under the startup
    name), /v1/unload_lora_adapter stops it (then 404s); bad loads are 400s naming the field."""
    path = make_adapter(str(tmp_path / "same"))  # the startup adapter's weights again
    kw: dict[str, Any] = dict(prompt="The sky is", max_tokens=6, temperature=0)
    load = {"lora_name": "smol-lora-2", "lora_path": path}
    status, body, _ = server.request("POST", "/v1/load_lora_adapter", load)
    assert status == 200 and b"added successfully" in body
    assert "smol-lora-2" in [m.id for m in client.models.list().data]
    got = client.completions.create(model="smol-lora-2", **kw).choices[0].text
    assert got == client.completions.create(model=ADAPTER, **kw).choices[0].text
    assert got != client.completions.create(model=MODEL, **kw).choices[0].text
    bad = [
        ({"lora_name": "third", "lora_path": path}, "max_loras"),  # both slots hold adapters
        ({"lora_name": "smol-lora-2", "lora_path": path}, "lora_name"),  # loaded already
        ({"lora_name": MODEL, "lora_path": path}, "lora_name"),
        ({"lora_name": "third", "lora_path": str(tmp_path)}, "lora_path"),
        ({"lora_name": "third"}, "lora_path"),
    ]
    for req, param in bad:
        status, err = server.json("POST", "/v1/load_lora_adapter", req)
        assert status == 400 and err["error"]["param"] == param, (req, err)
    status, body, _ = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "smol-lora-2"})
    assert status == 200 and b"removed successfully" in body
    assert "smol-lora-2" not in [m.id for m in client.models.list().data]
    status, err = server.json("POST", "/v1/completions", {"model": "smol-lora-2", **kw})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, err = server.json("POST", "/v1/unload_lora_adapter", {"lora_name": "smol-lora-2"})
    assert status == 404 and err["error"]["param"] == "lora_name"


def test_chat_stream_equals_nonstream_greedy(client: Any) -> None:
    kw = dict(messages=MSG, max_tokens=12, temperature=0)
    full = client.chat.completions.create(model=MODEL, **kw)
    texts, reasons, chunks = stream_chat(client, **kw)
    assert full.choices[0].message.role == "assistant"
    assert texts[0] == full.choices[0].message.content and texts[0]
    assert reasons == {0: [full.choices[0].finish_reason]}
    assert full.choices[0].finish_reason in ("stop", "length")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.delta.role is None for ch in chunks[1:] for c in ch.choices)
    assert full.system_fingerprint and chunks[0].system_fingerprint == full.system_fingerprint
    assert all(ch.usage is None for ch in chunks)


def test_completion_stream_equals_nonstream_greedy(client: Any) -> None:
    kw = dict(prompt="The capital of France is", max_tokens=10, temperature=0)
    full = client.completions.create(model=MODEL, **kw)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, stream=True, **kw)
        if c.choices
    )
    assert text == full.choices[0].text and text


def test_n2_indices_and_one_finish_reason_each(client: Any) -> None:
    texts, reasons, _ = stream_chat(
        client, messages=MSG, max_tokens=8, n=2, temperature=1.0, seed=7
    )
    assert sorted(texts) == [0, 1]
    assert all(len(r) == 1 and r[0] in ("stop", "length") for r in reasons.values())
    assert sorted(reasons) == [0, 1]
    full = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, n=2, seed=7)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens <= 16


def test_seed_reproducible(client: Any) -> None:
    kw = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234)
    a = client.completions.create(model=MODEL, **kw).choices[0].text
    b = client.completions.create(model=MODEL, **kw).choices[0].text
    assert a == b


def test_chat_logprobs_shapes(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.bytes == list(t.token.encode())
    # Greedy: the sampled token is the most likely one.
    assert all(t.token == t.top_logprobs[0].token for t in content)
    _, _, chunks = stream_chat(
        client, messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    streamed = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_completion_logprobs_legacy_format(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2
    )
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(2 <= len(d) <= 3 for d in lp.top_logprobs)


def test_echo_and_token_prompts(client: Any, tokenizer: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, echo=True, temperature=0
    )
    assert r.choices[0].text.startswith("Hello there")
    ids = tokenizer("Roses are red")["input_ids"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 * len(ids)
    r2 = client.completions.create(model=MODEL, prompt=["a b c", "d e"], max_tokens=2)
    assert sorted(c.index for c in r2.choices) == [0, 1]


def test_tokens_as_token_ids(client: Any, tokenizer: Any) -> None:
    """``return_tokens_as_token_ids``: logprobs name each token ``token_id:<id>`` (chat, the
    legacy completions format, streamed), the ids decoding to the text generated."""
    ids_of = lambda toks: [int(t.removeprefix("token_id:")) for t in toks]  # noqa: E731
    extra = {"return_tokens_as_token_ids": True}
    kw: dict[str, Any] = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=MSG, extra_body=extra, **kw)
    content = chat.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    assert tokenizer.decode(ids_of([c.token for c in content])) == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                     logprobs=2, extra_body=extra)  # fmt: skip
    lp = comp.choices[0].logprobs
    assert tokenizer.decode(ids_of(lp.tokens)) == comp.choices[0].text
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chunks = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                       logprobs=0, stream=True, extra_body=extra)  # fmt: skip
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_bad_words(client: Any, server: Server) -> None:
    """``bad_words``: read with the model's tokenizer; the greedy answer's word never appears
    once banned (chat and completions); a bad list is a 400 naming the field."""
    kw: dict[str, Any] = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    word = plain.split()[0].strip(".,")
    banned = client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0].text
    assert word in plain and word not in banned
    chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0)
    first = chat.choices[0].message.content.split()[0]
    again = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0,
                                           extra_body={"bad_words": [first]})  # fmt: skip
    assert not again.choices[0].message.content.startswith(first)
    status, err = server.json("POST", "/v1/completions", {"prompt": "Hi", "bad_words": [" "]})
    assert status == 400 and err["error"]["param"] == "bad_words"


def test_echo_logprobs_score_the_prompt(client: Any, tokenizer: Any) -> None:
    """What evaluation harnesses send to score a text (echo, logprobs, one token out): every
    prompt token after the first gets its logprob and top alternatives, streamed or not, and
    the continuation's greedy tokens score as they were generated."""
    text = "The capital of France is Paris. The capital of Italy is"
    n = len(tokenizer(text)["input_ids"])
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                  echo=True, logprobs=1)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    greedy = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                       logprobs=1)  # fmt: skip
    g = greedy.choices[0].logprobs
    scored = client.completions.create(model=MODEL, prompt=text + greedy.choices[0].text,
                                       max_tokens=1, temperature=0, echo=True, logprobs=1)  # fmt: skip
    s = scored.choices[0].logprobs
    assert s.token_logprobs[n : n + 4] == pytest.approx(g.token_logprobs, abs=1e-3)
    stream = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0,
                                       echo=True, logprobs=1, stream=True)  # fmt: skip
    streamed = [v for ch in stream for v in (ch.choices[0].logprobs.token_logprobs
                                              if ch.choices and ch.choices[0].logprobs else [])]  # fmt: skip
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    only = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                     logprobs=1)  # fmt: skip
    c = only.choices[0]
    assert c.text == text and only.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)


def test_prompt_logprobs_extension_on_chat_and_completions(
    server: Server, client: Any, tokenizer: Any
) -> None:
    """vLLM's ``prompt_logprobs`` (evaluation harnesses that score chat-formatted prompts):
    each prompt token after the first has its own entry (logprob, rank, text) and the k most
    likely; the same scores as completions' echo; with stream it is a 400 naming the field."""
    status, tok = server.json("POST", "/tokenize", {"model": MODEL, "messages": MSG})
    assert status == 200
    ids = tok["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 2})  # fmt: skip
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:], strict=True):
        assert str(tid) in entry and 1 <= len(entry) <= 3  # its own, plus the two likeliest
        own = entry[str(tid)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert sum(e["rank"] <= 2 for e in entry.values()) == 2
    # completions: the same prompt ids score the same, beside echo's figures
    cmp = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                    echo=True, logprobs=1, extra_body={"prompt_logprobs": 0})  # fmt: skip
    c = cmp.choices[0]
    got = [None if e is None else e[str(t)]["logprob"] for t, e in
           zip(ids, c.model_extra["prompt_logprobs"], strict=True)]  # fmt: skip
    assert got[0] is None and all(len(e) == 1 for e in c.model_extra["prompt_logprobs"][1:])
    assert got[1:] == pytest.approx(c.logprobs.token_logprobs[1 : len(ids)], abs=1e-5)
    assert got[1:] == pytest.approx([plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i],
                                    abs=1e-3)  # fmt: skip
    for bad in ({"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 99}):
        body = {"model": MODEL, "messages": MSG, "max_tokens": 1, **bad}
        status, err = server.json("POST", "/v1/chat/completions", body)
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", err


def test_usage_against_tokenizer(server: Server, client: Any, tokenizer: Any) -> None:
    prompt = "Write a haiku about the sea."
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    status, tok = server.json("POST", "/tokenize", {"model": MODEL, "messages": MSG})
    assert status == 200
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.prompt_tokens == tok["count"]
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def test_include_usage_raw_sse(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    status, data, headers = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    *chunks, last = payloads
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    assert all("usage" in c and c["usage"] is None for c in chunks)
    body.pop("stream_options")
    _, data, _ = server.request("POST", "/v1/chat/completions", body)
    assert all('"usage"' not in e for e in data.decode().split("\n\n"))


def _tokens_of(client: Any, prompt: str, n: int) -> list[str]:
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].logprobs.tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_never_leaks(client: Any, stream: bool) -> None:
    prompt = "List the days of the week:"
    toks = _tokens_of(client, prompt, 10)
    full = "".join(toks)
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(1, len(toks) - 1) if len(toks[i]) >= 2 and len(toks[i + 1]) >= 2)
    stop = toks[i][-2:] + toks[i + 1][:2]
    expected = full[: full.index(stop)]
    kw = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stop=[stop, "zzzz"],
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        r = client.completions.create(**kw)
        text, reasons = r.choices[0].text, [r.choices[0].finish_reason]
    assert text == expected and stop not in text
    assert reasons == ["stop"]


def test_chat_stop_string(client: Any) -> None:
    base = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=16, temperature=0)
    content = base.choices[0].message.content
    stop = content[3:6]
    texts, reasons, _ = stream_chat(client, messages=MSG, max_tokens=16, temperature=0, stop=stop)
    assert texts[0] == content[: content.index(stop)] and reasons[0] == ["stop"]


def test_sampling_extensions_accepted(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "cache_salt": "tenant-a",
            "priority": -3,
        },
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_logit_bias_and_allowed_token_ids(client: Any, tokenizer: Any) -> None:
    kw = dict(messages=MSG, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = client.chat.completions.create(model=MODEL, logit_bias={str(first): -100}, **kw)
    got = tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)
    assert got[0] != first
    word = tokenizer.encode(" ocean", add_special_tokens=False)
    assert len(word) == 1
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0.9, seed=1,
        logit_bias={str(word[0]): 100},
    )
    assert forced.choices[0].text == " ocean" * 3
    only = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=1.0, seed=2,
        extra_body={"allowed_token_ids": [word[0]]},
    )
    assert only.choices[0].text == " ocean" * 3


def test_reasoning_content_split_whole_and_streamed(client: Any) -> None:
    """The server runs ``--reasoning-parser qwen3``: an output that opens with <think> (forced
    here by a regex) gives its thinking as ``reasoning_content``, the same streamed or not."""
    kw = dict(
        messages=[{"role": "user", "content": "What is two plus two?"}], max_tokens=40,
        temperature=0, extra_body={"structured_outputs": {
            "regex": r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>The answer is [0-9]\."}},
    )  # fmt: skip
    msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert msg.content.startswith("The answer is ") and "think" not in msg.content
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            parts["content"] += c.delta.content or ""
            parts["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": msg.content}
    plain = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    kw["extra_body"]["include_reasoning"] = False  # the thinking dropped, the answer kept
    hidden = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert "reasoning_content" not in (hidden.model_extra or {}) and hidden.content == msg.content


def test_truncate_prompt_tokens(client: Any) -> None:
    long = "word " * 2000  # past the server's 1,024-token context
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 100})  # fmt: skip
    assert r.usage.prompt_tokens == 100
    assert r.choices[0].text.startswith(" word word") and len(r.choices[0].text) < len(long) // 10
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=3,
        extra_body={"truncate_prompt_tokens": -1},
    )  # the last tokens that leave room for max_tokens
    assert chat.usage.prompt_tokens == MAX_MODEL_LEN - 3 and chat.usage.completion_tokens >= 1


def test_reasoning_then_tool_call_streamed_as_whole(client: Any) -> None:
    """The tool-call parser reads only the content after the thinking, streamed as whole."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kw = dict(
        messages=[{"role": "user", "content": "Call f."}], max_tokens=40, temperature=0,
        tools=tools, extra_body={"structured_outputs": {
            "regex": r'<think>[a-z]{2,6}</think><tool_call>\{"name": "f", "arguments": \{\}\}</tool_call>'}},
    )  # fmt: skip
    msg = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "f" and not msg.content
    reasoning, content, calls = "", "", []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            calls += c.delta.tool_calls or []
    assert reasoning == msg.model_extra["reasoning_content"] and not content
    assert [c.function.name for c in calls] == ["f"]


def test_prefix_cache_reports_cached_tokens(client: Any) -> None:
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenize_detokenize(server: Server, tokenizer: Any) -> None:
    status, body = server.json("POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and body["tokens"] == tokenizer("Hello world")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    status, body = server.json("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "Hello world"


def test_health_ready_version(server: Server) -> None:
    assert server.request("GET", "/health", key=None)[0] == 200
    status, body = server.json("GET", "/ready", key=None)
    assert status == 200 and body["status"] == "ready"
    status, body = server.json("GET", "/version", key=None)
    assert status == 200 and body["version"]


def test_metrics_names(server: Server, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    m = server.metrics()
    for name in [
        "fulcrum:num_requests_running",
        "fulcrum:num_requests_waiting",
        "fulcrum:kv_cache_usage_perc",
        "fulcrum:prefix_cache_queries_total",
        "fulcrum:prefix_cache_hits_total",
        "fulcrum:num_preemptions_total",
        "fulcrum:prompt_tokens_total",
        "fulcrum:generation_tokens_total",
        "fulcrum:time_to_first_token_seconds_count",
        "fulcrum:inter_token_latency_seconds_count",
        "fulcrum:e2e_request_latency_seconds_count",
        "fulcrum:request_queue_time_seconds_count",
        "fulcrum:kv_cache_blocks_total",
        "fulcrum:kv_cache_blocks_free",
    ]:
        assert name in m, name
    assert m["fulcrum:generation_tokens_total"] >= 3 and m["fulcrum:prompt_tokens_total"] > 0
    assert m["fulcrum:time_to_first_token_seconds_count"] >= 1
    assert m["fulcrum:kv_cache_blocks_total"] > 0


def test_request_log(server: Server, client: Any) -> None:
    client.with_options(default_headers={"X-Conversation-Id": "conv-42"}).chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=3, extra_body={"cache_salt": "salt-1"}
    )
    client.completions.create(model=MODEL, prompt="Log me", max_tokens=2, user="user-7")
    with open(server.log_file) as f:
        records = [json.loads(line) for line in f]
    keys = {
        "request_id",
        "arrival_time",
        "endpoint",
        "model",
        "prompt_token_ids",
        "prompt",
        "messages",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "ttft_s",
        "e2e_s",
        "finish_reason",
        "cache_salt",
        "conversation_id",
    }
    assert all(set(r) == keys for r in records)
    chat = next(r for r in records if r["conversation_id"] == "conv-42")
    assert chat["endpoint"] == "chat" and chat["messages"][0]["content"] == MSG[0]["content"]
    assert chat["cache_salt"] == "salt-1" and chat["num_output_tokens"] >= 1
    assert chat["num_prompt_tokens"] == len(chat["prompt_token_ids"]) and chat["prompt"] is None
    assert 0 <= chat["ttft_s"] <= chat["e2e_s"] and chat["finish_reason"] in ("stop", "length")
    comp = next(r for r in records if r["conversation_id"] == "user-7")
    assert comp["endpoint"] == "completions" and comp["prompt"] == "Log me"
    assert comp["messages"] is None and comp["arrival_time"] > 1.6e9


def test_chat_return_token_ids_one_chunk_per_token(server: Server) -> None:
    """With return_token_ids every generated token reaches the client in its own chunk, whether
    or not it has text yet, so clients can time tokens one by one."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    status, whole = server.json("POST", "/v1/chat/completions", body)
    assert status == 200 and len(whole["choices"][0]["token_ids"]) == 8
    status, data, _ = server.request("POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    chunks = [json.loads(e[len("data: "):]) for e in data.decode().split("\n\n")[:-2]]
    ids = [c["choices"][0]["token_ids"] for c in chunks[1:] if c["choices"]]
    assert [len(i) for i in ids] == [1] * 8  # the role chunk first, then one chunk per step
    assert [t for i in ids for t in i] == whole["choices"][0]["token_ids"]
    assert "token_ids" not in chunks[0]["choices"][0]
