"""One real `fulcrum serve` process on the embedded model, shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from srv_helpers import (
    ADAPTER,
    API_KEY,
    MAX_MODEL_LEN,
    MAX_REQUEST_BYTES,
    Server,
    make_adapter,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = str(tmp_path_factory.mktemp("server"))
    s = start_server(
        tmp,
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-num-seqs",
        "512",  # the 500-stream test runs as one batch
        "--async-scheduling",
        "on",  # as on CUDA: step N+1 is launched before step N's tokens are read back
        "--reasoning-parser",
        "qwen3",  # only outputs that open with <think> are split: the others are untouched
        "--lora-modules",  # requests naming it run the adapter; the CPU runs eager anyway
        f"{ADAPTER}={make_adapter(tmp + '/adapter')}",
        "--allow-runtime-lora-updates",  # one more slot for an adapter loaded by a test
        "--max-loras",
        "2",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def client(server: Server) -> Any:
    import openai

    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
    )


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from fulcrum.model.loader.default_model import load_default_tokenizer

    return load_default_tokenizer()
