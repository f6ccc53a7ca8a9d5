"""Models without a tokenizer: token ids in and out, a 400 naming why for what needs text; and a
dummy-weights directory whose tokenizer.json sits beside its config.json is served with it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from srv_helpers import Server, start_server, stop_server

from model_factory import make_tiny_model

PROMPT = [5, 17, 42, 99]


def _byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens and an end token (id 256),
    small enough for the tiny models' 320-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<|end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("notok")
    bare = make_tiny_model(str(root / "bare"), "llama")
    with_tok = str(root / "dummy_with_tok")
    os.makedirs(with_tok)
    with open(os.path.join(bare, "config.json")) as src, open(
        os.path.join(with_tok, "config.json"), "w"
    ) as dst:
        dst.write(src.read())
    _byte_tokenizer(with_tok)
    return {"bare": bare, "dummy_with_tok": with_tok}


@pytest.fixture(scope="module")
def bare_server(
    model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    s = start_server(
        str(tmp_path_factory.mktemp("bare")), "--model", model_dirs["bare"],
        "--kv-cache-memory", "0.05",
    )
    yield s
    stop_server(s)


def test_dummy_directory_uses_its_own_tokenizer(model_dirs: dict[str, str]) -> None:
    from fulcrum.model.loader.resolve import resolve_model_config

    d = model_dirs["dummy_with_tok"]
    assert resolve_model_config(d, load_format="dummy").tokenizer_path == d
    assert resolve_model_config(d, load_format="dummy", tokenizer="/x").tokenizer_path == "/x"
    assert resolve_model_config(model_dirs["bare"], load_format="dummy").tokenizer_path is None


def test_dummy_directory_with_tokenizer_serves_text(
    model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    s = start_server(
        str(tmp_path_factory.mktemp("dummytok")), "--model", model_dirs["dummy_with_tok"],
        "--load-format", "dummy", "--kv-cache-memory", "0.05",
    )
    try:
        status, out = s.json("POST", "/tokenize", {"prompt": "hi!"})
        assert status == 200 and len(out["tokens"]) == 3, out
        assert s.json("POST", "/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": "hi!"})
        status, out = s.json("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                         "ignore_eos": True, "logprobs": 1})
        assert status == 200 and len(out["choices"][0]["logprobs"]["tokens"]) == 3, out
        assert "token_ids" not in out["choices"][0]  # only when asked for (or no tokenizer)
        body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}
        status, out = s.json("POST", "/v1/completions", body)
        choice = out["choices"][0]
        prompt_ids = s.json("POST", "/tokenize", {"prompt": "hi"})[1]["tokens"]
        assert status == 200 and len(choice["token_ids"]) == 3
        assert choice["prompt_token_ids"] == prompt_ids
        status, out = s.json("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200, out
    finally:
        stop_server(s)


def test_token_ids_in_and_out(bare_server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, out = bare_server.json("POST", "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == "" and choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5

    # Streamed: a chunk per step, each with its new token ids, adding up to the same output.
    status, data, _ = bare_server.request("POST", "/v1/completions", dict(body, stream=True))
    assert status == 200
    events = [e[6:] for e in data.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    ids = [t for c in chunks for t in c.get("token_ids") or []]
    assert ids == choice["token_ids"]
    assert len([c for c in chunks if c.get("token_ids")]) >= 3  # not one chunk at the end
    assert chunks[0]["prompt_token_ids"] == PROMPT


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["Hello", "World"], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ["x"]}, "stop"),
        ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
        ("/tokenize", {"prompt": "Hi"}, "prompt"),
        ("/detokenize", {"tokens": PROMPT}, "tokens"),
    ],
)
def test_what_needs_text_is_400(bare_server: Server, path: str, body: dict[str, Any],
                                param: str) -> None:
    status, out = bare_server.json("POST", path, body)
    assert status == 400, out
    assert out["error"]["param"] == param and "tokenizer" in out["error"]["message"], out


def test_stop_token_ids_work_without_tokenizer(bare_server: Server) -> None:
    status, out = bare_server.json("POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    first = out["choices"][0]["token_ids"][0]
    status, out = bare_server.json("POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stop_token_ids": [first]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
