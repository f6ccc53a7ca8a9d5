"""The process boundary: the engine core runs its busy loop in a child process.

```
 server process (asyncio)                         core process (no event loop)
 CoreClient.add_request ──PUSH──▶ ipc://…-in ──PULL──▶ drain input → core.add_request / abort
 CoreClient.get_output  ◀──PULL── ipc://…-out ◀──PUSH── step() while unfinished → outputs
```

Every message is ``[kind, msgpack payload]`` with msgspec structs (``core_messages.py``) —
nothing is pickled on the sockets. The child (``core_process.py``) is started with
multiprocessing's *spawn* method (a fresh interpreter: torch and ZMQ never cross a fork); only
the picklable core factory travels in the process-start pipe.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import tempfile
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from fulcrum.engine.core_messages import (
    ABORT,
    ADAPTERS,
    ADD,
    CALL,
    CALL_RESULT,
    DEAD,
    OUTPUTS,
    READY,
    REQUEST_ERROR,
    SHUTDOWN,
    STATS,
    CallResult,
    CoreCall,
    CoreDead,
    CoreFactory,
    CoreMessage,
    CoreReady,
    CoreUnreachableError,
    LoRAAdapters,
    RequestError,
)
from fulcrum.engine.core_process import run_engine_core
from fulcrum.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


def ipc_paths() -> tuple[str, str]:
    """Fresh socket paths for one client's input and output."""
    base = os.path.join(tempfile.gettempdir(), f"fulcrum-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return base + "-in", base + "-out"


class CoreClient:
    """Frontend handle of the core process: send requests/aborts, await outputs."""

    def __init__(
        self,
        factory: CoreFactory | None,
        *,
        name: str = "fulcrum-engine-core",
        paths: tuple[str, str] | None = None,
        index: int = 0,
    ) -> None:
        self.factory = factory
        self.name = name
        self.index = index  # this API process's place among the core's clients
        self._paths = paths or ipc_paths()
        self.input_addr, self.output_addr = (f"ipc://{p}" for p in self._paths)
        self._core_pid: int | None = None  # a core this client attached to, not started
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._inp = self._ctx.socket(zmq.PUSH)
        self._inp.setsockopt(zmq.SNDHWM, 0)
        self._inp.setsockopt(zmq.LINGER, 0)
        self._out = self._actx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._enc = msgspec.msgpack.Encoder()
        self._dec_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._dec_error = msgspec.msgpack.Decoder(RequestError)
        self._dec_dead = msgspec.msgpack.Decoder(CoreDead)
        self._dec_result = msgspec.msgpack.Decoder(CallResult)
        self._dec_adapters = msgspec.msgpack.Decoder(LoRAAdapters)
        self._proc: mp.process.BaseProcess | None = None
        self._closed = False
        self.ready: CoreReady | None = None

    @classmethod
    def attach(cls, paths: tuple[str, str], core_pid: int, index: int) -> CoreClient:
        """A client of a core process that another process started (``--api-server-count``):
        it binds its own pair of sockets, which the core connects to, and never stops the core."""
        client = cls(None, paths=paths, index=index)
        client._core_pid = core_pid
        client._inp.bind(client.input_addr)
        client._out.bind(client.output_addr)
        return client

    def start(self) -> None:
        assert self.factory is not None, "an attached client does not start a core"
        self._inp.bind(self.input_addr)
        self._out.bind(self.output_addr)
        ctx = mp.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.factory, self.input_addr, self.output_addr, os.getpid()),
            name=self.name,
        )
        self._proc.start()
        atexit.register(self.shutdown)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._core_pid

    def is_alive(self) -> bool:
        if self._core_pid is not None:
            try:
                os.kill(self._core_pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        return self._proc is not None and self._proc.is_alive()

    async def wait_ready(self, timeout: float = 600.0) -> CoreReady:
        """Wait for the core's handshake; raise RuntimeError if it dies or times out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._out.poll(200):
                kind, payload = await self._out.recv_multipart()
                if kind == READY:
                    self.ready = msgspec.msgpack.decode(payload, type=CoreReady)
                    return self.ready
                if kind == DEAD:
                    raise RuntimeError(
                        f"engine core failed to start: {self._dec_dead.decode(payload).message}"
                    )
            elif not self.is_alive():
                code = self._proc.exitcode if self._proc else None
                raise RuntimeError(f"engine core process exited during startup (code {code}).")
        raise RuntimeError(f"engine core not ready after {timeout:.0f} s.")

    def _send(self, frames: list[bytes], required: bool) -> None:
        # NOBLOCK: a PUSH socket with no live peer would block the event loop forever.
        try:
            self._inp.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if required:
                raise CoreUnreachableError("the engine core process is not reachable.") from None

    def add_request(self, req: EngineCoreRequest) -> None:
        """Send a request; raises CoreUnreachableError when the core process is gone."""
        req.client_index = self.index
        self._send([ADD, self._enc.encode(req)], required=True)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed:
            self._send([ABORT, self._enc.encode(request_ids)], required=False)

    def call(self, call: CoreCall) -> None:
        """Send a call to the core (its ``CallResult`` comes through ``get_output``); raises
        CoreUnreachableError when the core process is gone."""
        call.client_index = self.index
        self._send([CALL, self._enc.encode(call)], required=True)

    def request_stats(self) -> None:
        """Ask the core to push its current SchedulerStats (answered as an outputs message)."""
        if not self._closed:
            self._send([STATS, b""], required=False)

    async def get_output(self) -> CoreMessage:
        """Next message from the core; a ``CoreDead`` if the process is gone."""
        while True:
            if await self._out.poll(1000):
                kind, payload = await self._out.recv_multipart()
                if kind == OUTPUTS:
                    return self._dec_outputs.decode(payload)
                if kind == REQUEST_ERROR:
                    return self._dec_error.decode(payload)
                if kind == DEAD:
                    return self._dec_dead.decode(payload)
                if kind == CALL_RESULT:
                    return self._dec_result.decode(payload)
                if kind == ADAPTERS:
                    return self._dec_adapters.decode(payload)
                logger.warning("unexpected message kind %r from the core", kind)
            elif not self.is_alive():
                code = self._proc.exitcode if self._proc else None
                return CoreDead(f"engine core process exited (code {code}).")

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the child (SHUTDOWN, then SIGTERM, then SIGKILL) and remove the sockets."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc  # None for an attached client: the process that started the core stops it
        if proc is not None and proc.is_alive():
            try:
                self._inp.send_multipart([SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        self._inp.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        for p in self._paths:
            try:
                os.unlink(p)
            except OSError:
                pass
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass
