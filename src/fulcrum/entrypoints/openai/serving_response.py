"""What a chat and a completions response share once the request is submitted: the chunk and body
envelopes, SSE framing with errors as a last event, the whole-body path with disconnect handling,
aborting on the way out and logging each request once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fulcrum.engine.async_engine import EngineDeadError
from fulcrum.entrypoints.openai.errors import OpenAIError, engine_dead, value_error
from fulcrum.entrypoints.openai.protocol import SamplingRequest
from fulcrum.entrypoints.openai.serving_base import OpenAIServing, run_until_disconnect
from fulcrum.entrypoints.openai.sse import DONE, encode_json, sse_error, sse_event


class ResponseContext(ABC):
    """One request's response assembly, streamed (``stream``) or whole (``full``).

    A subclass says how engine outputs become chunks (``events``), how the whole body's choices
    and usage are made (``collect`` then ``whole``) and what goes to the request log (``log``).
    """

    object: ClassVar[str]  # the whole body's "object"
    chunk_object: ClassVar[str]  # each streamed chunk's "object"

    def __init__(
        self,
        serving: OpenAIServing,
        req: SamplingRequest,
        raw: Request,
        rid: str,
        model: str,
        arrival: float,
    ) -> None:
        self.s, self.raw, self.rid, self.model, self.arrival = serving, raw, rid, model, arrival
        self.created = int(arrival)
        self.fp = serving.state.system_fingerprint
        self.logged = False
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    # ------------------------------------------------------------------ what a subclass says
    @abstractmethod
    def request_ids(self) -> list[str]:
        """The engine requests this response waits on."""

    @abstractmethod
    def log(self) -> None:
        """Write the request log's record(s); sets ``logged``."""

    @abstractmethod
    def events(self, source: Any) -> AsyncIterator[dict[str, Any]]:
        """The streamed chunks, in order (the envelope from ``chunk``)."""

    @abstractmethod
    async def collect(self, source: Any) -> None:
        """Wait for the final outputs (whole-body path)."""

    @abstractmethod
    def whole(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The whole body's choices and usage, after ``collect``."""

    # ------------------------------------------------------------------ shared
    async def respond(self, source: Any, stream: bool) -> Response:
        """Stream ``source`` as SSE (``cleanup`` runs after the response, also on a disconnect),
        or answer with the whole body."""
        if stream:
            return StreamingResponse(
                self.stream(source),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(self.cleanup),
            )
        return await self.full(source)

    async def cleanup(self) -> None:
        """Abort whatever is still running (client gone before or while streaming); log once."""
        for rid in self.request_ids():
            self.s.engine.abort(rid)
        if not self.logged:
            self.log()

    def extra(self) -> dict[str, Any]:
        """Top-level fields of the whole response beside the choices and usage."""
        return {}

    def envelope(self, object: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fp,
            "choices": choices,
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed chunk; with include_usage every chunk carries ``"usage": null`` but the
        last, as OpenAI's do."""
        c = self.envelope(self.chunk_object, choices)
        if self.include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.envelope(self.chunk_object, []), "usage": usage}

    async def stream(self, source: Any) -> AsyncIterator[bytes]:
        """SSE: each chunk, an error event if the request fails, then ``[DONE]``."""
        try:
            async for event in self.events(source):
                yield sse_event(event)
        except OpenAIError as e:
            yield sse_error(e)
        except ValueError as e:
            yield sse_error(value_error(e))
        except EngineDeadError as e:
            yield sse_error(engine_dead(str(e)))
        finally:
            self.log()
        yield DONE

    async def collect_whole(self, source: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """``whole()`` once every output is final (aborted if the client leaves first); the
        request is logged."""
        try:
            await run_until_disconnect(self.raw, self.collect(source))
        except BaseException as e:
            await self.cleanup()
            if isinstance(e, EngineDeadError):
                raise engine_dead(str(e)) from None
            if isinstance(e, ValueError):
                raise value_error(e) from None
            raise
        choices, usage = self.whole()
        self.log()
        return choices, usage

    async def full(self, source: Any) -> Response:
        """The whole body, once every output is final."""
        choices, usage = await self.collect_whole(source)
        body = {**self.envelope(self.object, choices), "usage": usage, **self.extra()}
        return Response(encode_json(body), media_type="application/json")
