"""Structured output for a reasoning model through the server: the thinking is free and the
constraint starts after ``</think>`` (vLLM's behaviour). The embedded model gets a tokenizer whose
two unused special tokens are renamed ``<think>`` and ``</think>`` (single, non-special tokens,
as a reasoning model's are), served with ``--reasoning-parser deepseek_r1``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from srv_helpers import API_KEY, MODEL, Server, start_server, stop_server

RENAMED = {"<jupyter_start>": "<think>", "<jupyter_text>": "</think>"}


def _reasoning_tokenizer(path: str) -> None:
    from fulcrum.model.loader.default_model import load_default_tokenizer

    load_default_tokenizer().save_pretrained(path)
    for name in os.listdir(path):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(path, name)) as f:
            text = f.read()
        for old, new in RENAMED.items():
            text = text.replace(json.dumps(old), json.dumps(new))
        data = json.loads(text)
        entries = data.get("added_tokens", []) + list(data.get("added_tokens_decoder", {}).values())
        for entry in entries:
            if entry["content"] in RENAMED.values():
                entry["special"] = False  # kept in the text, where the parser finds them
        for key in ("additional_special_tokens", "extra_special_tokens"):
            if isinstance(data.get(key), list):
                data[key] = [t for t in data[key] if t not in RENAMED.values()]
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("reasoning")
    tok = str(tmp / "tokenizer")
    _reasoning_tokenizer(tok)
    s = start_server(str(tmp), "--api-key", API_KEY, "--max-model-len", "512", "--tokenizer", tok,
                     "--reasoning-parser", "deepseek_r1")  # fmt: skip
    yield s
    stop_server(s)


def test_thinking_free_answer_constrained(server: Server) -> None:
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(server.log_file), "tokenizer"))
    end = tok.convert_tokens_to_ids("</think>")
    kw: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": "Pick a number."}], temperature=0,
        max_tokens=12,
    )  # fmt: skip
    free = client.chat.completions.create(**kw).choices[0].message
    # deepseek_r1: an output without </think> is all thinking; under a grammar it stays free
    regex = {"structured_outputs": {"regex": "[0-9]{3}"}}
    thinking = client.chat.completions.create(**kw, extra_body=regex).choices[0].message
    assert thinking.model_extra["reasoning_content"] == free.model_extra["reasoning_content"]
    assert not re.fullmatch("[0-9]{3}", thinking.model_extra["reasoning_content"])
    # </think> forced as the first token: the answer after it follows the regex (the bias
    # stays on, the grammar's mask wins over it)
    forced = client.chat.completions.create(
        **kw, logit_bias={str(end): 100}, extra_body=regex
    ).choices[0].message  # fmt: skip
    assert forced.model_extra["reasoning_content"] == ""
    assert re.fullmatch("[0-9]{3}", forced.content)
    streamed = ""
    for chunk in client.chat.completions.create(**kw, logit_bias={str(end): 100},
                                                extra_body=regex, stream=True):  # fmt: skip
        streamed += "".join(c.delta.content or "" for c in chunk.choices)
    assert streamed == forced.content
