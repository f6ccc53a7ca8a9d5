"""`fulcrum serve --api-server-count N`: N HTTP processes in front of one engine core.

At tens of thousands of streamed tokens per second, one Python process cannot parse requests,
render chat templates, detokenize and frame every SSE chunk without delaying the streams it
serves. This launcher spreads that work::

    launcher (this process: starts, watches and stops the others)
      ├─ engine core      one PULL socket connected to every API process's input address,
      │                   one PUSH socket per API process (a request's outputs go to its sender)
      ├─ API process 0    binds its own pair of ZMQ sockets; listens on the port (SO_REUSEPORT)
      ├─ ...
      └─ API process N-1  the kernel spreads new connections over the N listening sockets

Prometheus counters and histograms are aggregated over the processes (prometheus_client's
multiprocess mode, in a private folder); the scheduler's gauges come from the core's stats, which
every process receives. The queue limit (``--max-queued-requests``) is split evenly. SIGTERM or
Ctrl-C drains every API process (each as ``fulcrum serve`` would), then the core stops; if the core
or any API process dies, the others are stopped and the launcher exits non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def listening_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket on (host, port) that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
        sock.set_inheritable(True)
    return sock


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)  # the launcher is gone: nobody will stop this process


def _api_main(
    args: argparse.Namespace,
    options: Any,
    engine_config: Any,
    paths: tuple[str, str],
    core_pid: int,
    index: int,
    port: int,
    parent_pid: int,
) -> None:
    from fulcrum.entrypoints.openai.api_process import serve_api

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    sock = listening_socket(args.host, port, listen=True)
    args = argparse.Namespace(**{**vars(args), "port": port})
    raise SystemExit(serve_api(args, options, engine_config, (paths, core_pid, index), [sock]))


def run_multi_api(args: argparse.Namespace, options: Any, engine_config: Any) -> int:
    from fulcrum.engine.core_client import ipc_paths
    from fulcrum.engine.core_process import EngineCoreFactory, run_engine_core

    n = args.api_server_count
    # Reserve the port (port 0 picks one) without listening: connections go to the API
    # processes' listening sockets only.
    reserve = listening_socket(args.host, args.port, listen=False)
    port = reserve.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="fulcrum-metrics-")
    os.environ[_MULTIPROC_ENV] = metrics_dir  # read by prometheus_client in each API process
    paths = [ipc_paths() for _ in range(n)]
    ctx = mp.get_context("spawn")
    core = ctx.Process(
        target=run_engine_core,
        args=(
            EngineCoreFactory(engine_config),
            [f"ipc://{p[0]}" for p in paths],
            [f"ipc://{p[1]}" for p in paths],
            os.getpid(),
        ),
        name="fulcrum-engine-core",
    )
    core.start()
    queued = math.ceil(options.max_queued_requests / n)
    per_process = dataclasses.replace(options, max_queued_requests=queued)
    apis = [
        ctx.Process(
            target=_api_main,
            args=(args, per_process, engine_config, paths[i], core.pid, i, port, os.getpid()),
            name=f"fulcrum-api-{i}",
        )
        for i in range(n)
    ]
    for p in apis:
        p.start()
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if signum == signal.SIGTERM:  # Ctrl-C's SIGINT reaches the whole process group itself
            for p in apis:  # each drains as a single `fulcrum serve` does
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        while True:
            dead = [p for p in apis if not p.is_alive()]
            if not core.is_alive() and not stopping:
                logger.error("the engine core exited (code %s); stopping", core.exitcode)
                code = 1
                break
            if stopping and len(dead) == len(apis):
                code = 0 if all(p.exitcode == 0 for p in apis) else 1
                break
            if dead and not stopping:
                logger.error("%s exited (code %s); stopping", dead[0].name, dead[0].exitcode)
                code = 1
                break
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(apis, timeout=options.shutdown_timeout + 10)
        _stop([core], timeout=10)
        reserve.close()
        for p in paths:
            for path in p:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _stop(procs: list[Any], timeout: float) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2)
