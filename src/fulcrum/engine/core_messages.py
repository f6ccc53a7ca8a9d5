"""The messages between the API process and the engine core process: each is ``[kind, msgpack
payload]`` with a msgspec struct from ``fulcrum.protocol`` or one of these (the handshake, a refused
request, a core call's result, the served adapters, the core's death) -- nothing is pickled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from fulcrum.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

# Frontend → core.
ADD, ABORT, STATS, SHUTDOWN, CALL = b"A", b"X", b"S", b"Q", b"C"
# Core → frontend.
READY, OUTPUTS, REQUEST_ERROR, DEAD, CALL_RESULT, ADAPTERS = b"R", b"O", b"E", b"D", b"c", b"L"

# The core's methods a frontend may call between steps (``CoreCall``), each taking strings;
# what they change of the served adapters is pushed to every frontend (``LoRAAdapters``).
CORE_CALLS = ("add_lora", "remove_lora")


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
