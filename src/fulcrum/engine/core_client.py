"""The process boundary: the engine core runs its busy loop in a child process.

```
 server process (asyncio)                         core process (no event loop)
 CoreClient.add_request ──PUSH──▶ ipc://…-in ──PULL──▶ drain input → core.add_request / abort
 CoreClient.get_output  ◀──PULL── ipc://…-out ◀──PUSH── step() while unfinished → outputs
```

Every message is ``[kind, msgpack payload]`` with msgspec structs from ``protocol.py``
(plus the few handshake structs below) — nothing is pickled on the sockets. The child is started
with multiprocessing's *spawn* method (a fresh interpreter: torch and ZMQ never cross a fork);
only the picklable core factory travels in the process-start pipe. The child exits when its
parent dies (a watchdog thread polls the parent pid), on SIGTERM, and on a SHUTDOWN message.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from fulcrum.engine.step_trace import StepTrace
from fulcrum.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

# Frontend → core.
ADD, ABORT, STATS, SHUTDOWN, CALL = b"A", b"X", b"S", b"Q", b"C"
# Core → frontend.
READY, OUTPUTS, REQUEST_ERROR, DEAD, CALL_RESULT, ADAPTERS = b"R", b"O", b"E", b"D", b"c", b"L"

# The core's methods a frontend may call between steps (``CoreCall``), each taking strings;
# what they change of the served adapters is pushed to every frontend (``LoRAAdapters``).
CORE_CALLS = ("add_lora", "remove_lora")

_IDLE_POLL_MS = 500


class CoreReady(msgspec.Struct):
    """Handshake: what the frontend must know about the loaded engine."""

    pid: int
    max_model_len: int = 0  # 0: unknown, the frontend keeps its own value
    vocab_size: int = 0
    num_blocks_total: int = 0


class RequestError(msgspec.Struct):
    """``add_request`` refused a request (e.g. ValueError); the message is user-facing."""

    request_id: str
    message: str
    is_value_error: bool = True


class CoreCall(msgspec.Struct):
    """A frontend's call of one of ``CORE_CALLS``, answered by a ``CallResult``."""

    call_id: int
    method: str
    args: list[str]
    client_index: int = 0


class CallResult(msgspec.Struct):
    """``error`` None: done. ``kind``: value (a bad argument, the message names the field),
    not_found (nothing of that name) or internal."""

    call_id: int
    error: str | None = None
    kind: str = "value"


class LoRAAdapters(msgspec.Struct):
    """The adapters the core serves now (name -> directory), after a call changed them."""

    adapters: dict[str, str]


class CoreDead(msgspec.Struct):
    """The core failed and its process is exiting."""

    message: str


CoreMessage = EngineCoreOutputs | RequestError | CoreDead | CallResult | LoRAAdapters


class CoreUnreachableError(RuntimeError):
    """The core process does not take messages any more (it died)."""


class EngineCoreLike(Protocol):
    """What the child loop needs from an engine core (``fulcrum.engine.core.EngineCore``)."""

    def add_request(self, req: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def step(self) -> EngineCoreOutputs: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_stats(self) -> SchedulerStats: ...
    def shutdown(self) -> None: ...


CoreFactory = Callable[[], EngineCoreLike]


@dataclass
class EngineCoreFactory:
    """Builds the real ``EngineCore`` in the child (the config is pickled into the start pipe)."""

    config: Any  # fulcrum.config.EngineConfig

    def __call__(self) -> EngineCoreLike:
        from fulcrum.engine.core import EngineCore

        return EngineCore(self.config)


def _describe(core: Any) -> CoreReady:
    def find(*paths: str) -> int:
        for path in paths:
            obj: Any = core
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
                return int(obj)
            except (AttributeError, TypeError, ValueError):
                continue
        return 0

    stats = core.get_stats()
    return CoreReady(
        pid=os.getpid(),
        max_model_len=find(
            "max_model_len",
            "config.scheduler_config.max_model_len",
            "config.model_config.max_model_len",
        ),
        vocab_size=find("vocab_size", "config.model_config.vocab_size"),
        num_blocks_total=int(stats.num_blocks_total),
    )


# --------------------------------------------------------------------------- child process


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)  # orphaned: nobody reads our outputs any more


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


class _CoreLoop:
    """Drain the input socket, step while there is work, push outputs, block when idle.

    With several API processes (``outs`` has one socket each), a request's outputs and errors go
    back to the process that sent it (``EngineCoreRequest.client_index``); stats and a failure
    reach all of them."""

    def __init__(self, core: EngineCoreLike, inp: zmq.Socket, outs: list[zmq.Socket]) -> None:
        self.core, self.inp, self.outs = core, inp, outs
        self.owner: dict[str, int] = {}  # request id -> client index, with several clients
        self.enc = msgspec.msgpack.Encoder()
        self.req_dec = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_dec = msgspec.msgpack.Decoder(list[str])
        self.call_dec = msgspec.msgpack.Decoder(CoreCall)
        self.running = True
        self.need_step = False  # an abort frees its blocks in the next step
        self.last_stats: list[SchedulerStats | None] = [None] * len(outs)

    def run(self) -> None:
        trace = StepTrace.from_env("core")
        try:
            while self.running:
                t0 = time.time()
                busy = self.core.has_unfinished_requests() or self.need_step
                self._drain(block=not busy)
                if not self.running:
                    break
                if self.core.has_unfinished_requests() or self.need_step:
                    self.need_step = False
                    t1 = time.time()
                    outs = self.core.step()
                    t2 = time.time()
                    self._push(outs)
                    if trace is not None:
                        tokens, reqs, new = getattr(self.core, "last_batch", (0, 0, 0))
                        trace.record(
                            {
                                "t": t0,
                                "drain": t1 - t0,
                                "step": t2 - t1,
                                "push": time.time() - t2,
                                "out": len(outs.outputs),
                                "tokens": tokens,
                                "reqs": reqs,
                                "new": new,
                            }
                        )
                else:
                    self._push_stats_if_changed()
        finally:
            if trace is not None:
                trace.close()

    def _drain(self, block: bool) -> None:
        while block and self.running:
            if self.inp.poll(_IDLE_POLL_MS):
                break
        while self.running:
            try:
                kind, payload = self.inp.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(kind, payload)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ADD:
            req = self.req_dec.decode(payload)
            client = req.client_index if req.client_index < len(self.outs) else 0
            try:
                self.core.add_request(req)
                if len(self.outs) > 1:
                    self.owner[req.request_id] = client
            except ValueError as e:
                self._send(REQUEST_ERROR, RequestError(req.request_id, str(e)), client)
            except Exception as e:  # a bad request must not take the engine down
                logger.exception("add_request failed for %s", req.request_id)
                msg = f"{type(e).__name__}: {e}"
                self._send(REQUEST_ERROR, RequestError(req.request_id, msg, False), client)
        elif kind == ABORT:
            self.core.abort_requests(self.ids_dec.decode(payload))
            self.need_step = True
        elif kind == STATS:
            self.last_stats = [None] * len(self.outs)  # force a push
        elif kind == SHUTDOWN:
            self.running = False
        elif kind == CALL:
            self._call(self.call_dec.decode(payload))

    def _call(self, call: CoreCall) -> None:
        client = call.client_index if call.client_index < len(self.outs) else 0
        result = CallResult(call.call_id)
        try:
            if call.method not in CORE_CALLS or not hasattr(self.core, call.method):
                raise ValueError(f"{call.method}: not something this engine core does.")
            getattr(self.core, call.method)(*call.args)
        except LookupError as e:
            result = CallResult(call.call_id, str(e), "not_found")
        except ValueError as e:
            result = CallResult(call.call_id, str(e), "value")
        except Exception as e:  # a failed call must not take the engine down
            logger.exception("%s failed", call.method)
            result = CallResult(call.call_id, f"{type(e).__name__}: {e}", "internal")
        loras = getattr(self.core, "loras", None)
        if result.error is None and loras is not None:
            # every frontend first, so the caller's next request already sees the change
            update = LoRAAdapters(loras.adapters())
            for i in range(len(self.outs)):
                self._send(ADAPTERS, update, i)
        self._send(CALL_RESULT, result, client)

    def _push(self, outs: EngineCoreOutputs) -> None:
        if outs.stats is None:
            outs.stats = self.core.get_stats()
        if not outs.timestamp:
            outs.timestamp = time.time()
        if len(self.outs) == 1:
            if outs.outputs or outs.stats != self.last_stats[0]:
                self.last_stats[0] = outs.stats
                self._send(OUTPUTS, outs)
            return
        per_client: list[list] = [[] for _ in self.outs]
        for o in outs.outputs:
            client = self.owner.get(o.request_id, 0)
            if o.finish_reason is not None:
                self.owner.pop(o.request_id, None)  # n > 1: the request's last sequence ends it
            per_client[client].append(o)
        for i, mine in enumerate(per_client):
            if mine or outs.stats != self.last_stats[i]:
                self.last_stats[i] = outs.stats
                self._send(OUTPUTS, EngineCoreOutputs(mine, outs.stats, outs.timestamp), i)

    def _push_stats_if_changed(self) -> None:
        self._push(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))

    def _send(self, kind: bytes, msg: msgspec.Struct, client: int = 0) -> None:
        self.outs[client].send_multipart([kind, self.enc.encode(msg)], copy=False)


def run_engine_core(
    factory: CoreFactory,
    input_addr: str | list[str],
    output_addr: str | list[str],
    parent_pid: int,
) -> None:
    """Entry point of the core process: one input and one output address per API process."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s core %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which drains
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    for addr in [input_addr] if isinstance(input_addr, str) else input_addr:
        inp.connect(addr)  # one PULL fair-queues every API process's requests
    outs = []
    for addr in [output_addr] if isinstance(output_addr, str) else output_addr:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, 0)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(addr)
        outs.append(out)
    enc = msgspec.msgpack.Encoder()
    core: EngineCoreLike | None = None
    try:
        core = factory()
        # The engine lives as long as this process: keep what it built (model, graphs, tables)
        # out of the garbage collector's scans, which would otherwise stall busy-loop steps.
        gc.collect()
        gc.freeze()
        ready = enc.encode(_describe(core))
        for out in outs:
            out.send_multipart([READY, ready])
        _CoreLoop(core, inp, outs).run()
    except SystemExit:
        pass
    except BaseException as e:
        tb = traceback.format_exc()
        logger.error("engine core failed:\n%s", tb)
        dead = enc.encode(CoreDead(f"{type(e).__name__}: {e}"))
        for out in outs:
            out.send_multipart([DEAD, dead])
        raise SystemExit(1) from None
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                logger.exception("engine core shutdown failed")
        inp.close(linger=0)
        for out in outs:
            out.close()
        ctx.term()


# --------------------------------------------------------------------------- server side


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
