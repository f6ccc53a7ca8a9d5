"""The engine core's process: build the core, then drain requests, step while there is work and
push outputs until told to stop (``core_client.py`` draws the sockets). It exits when its parent
dies (a watchdog thread polls the parent pid), on SIGTERM, and on a SHUTDOWN message."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from fulcrum.engine.core_messages import (
    ABORT,
    ADAPTERS,
    ADD,
    CALL,
    CALL_RESULT,
    CORE_CALLS,
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
    CoreReady,
    EngineCoreLike,
    LoRAAdapters,
    RequestError,
)
from fulcrum.engine.step_trace import StepTrace
from fulcrum.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500


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
        # With several clients: request id -> [client index, its sequences not finished yet]
        self.owner: dict[str, list[int]] = {}
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
                    self.owner[req.request_id] = [client, max(1, req.sampling_params.n)]
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
            owner = self.owner.get(o.request_id)
            per_client[owner[0] if owner is not None else 0].append(o)
            if owner is not None and o.finish_reason is not None:
                owner[1] -= 1  # each of the n sequences finishes once (stop, length or abort)
                if not owner[1]:
                    del self.owner[o.request_id]
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
