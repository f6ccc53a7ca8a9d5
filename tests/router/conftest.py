"""Three real `fulcrum serve` workers on the embedded model (started once, in parallel) and a
fixture that starts `fulcrum router` processes in front of them."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from router_helpers import Router, start_router

from server.srv_helpers import Server, start_server, stop_server

WORKER_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    dirs = [str(tmp_path_factory.mktemp(f"worker{i}")) for i in range(3)]
    with ThreadPoolExecutor(3) as ex:
        servers = list(ex.map(lambda d: start_server(d, *WORKER_ARGS), dirs))
    yield servers
    for s in servers:
        stop_server(s)


@pytest.fixture
def make_router() -> Iterator:
    routers: list[Router] = []

    def make(urls: list[str], *extra: str) -> Router:
        routers.append(start_router(urls, *extra))
        return routers[-1]

    yield make
    for r in routers:
        r.stop()
