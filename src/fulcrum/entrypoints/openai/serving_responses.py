"""``POST /v1/responses``: the Responses API on top of the chat path. The request becomes a chat
request (``responses_protocol``); the chat context's message or its streamed deltas become the
response's output items: a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` with one
``output_text`` part, and one ``function_call`` item per tool call.

Streamed, the events are OpenAI's: ``response.created``, ``response.in_progress``, then per item
``output_item.added``, its deltas (``output_text.delta``, ``reasoning_text.delta``,
``function_call_arguments.delta``), their ``.done`` events and ``output_item.done``, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it). Each event
carries its ``sequence_number``; an error after the stream began is an ``error`` event."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fulcrum.engine.async_engine import EngineDeadError
from fulcrum.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead, value_error
from fulcrum.entrypoints.openai.protocol import ChatCompletionRequest
from fulcrum.entrypoints.openai.responses_protocol import (
    PARAM_NAMES,
    ResponsesRequest,
    chat_request,
)
from fulcrum.entrypoints.openai.serving_chat import ServingChat
from fulcrum.entrypoints.openai.sse import encode_json


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [part]}  # fmt: skip


def _reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}  # fmt: skip


def _function_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": "completed"}  # fmt: skip


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


class ServingResponses:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        if req.previous_response_id is not None:
            raise bad_request(
                "previous_response_id: this server stores no responses; send the whole "
                "conversation in input.",
                "previous_response_id",
            )
        if req.background:
            raise bad_request("background: responses run in the foreground here.", "background")
        try:
            chat = ChatCompletionRequest.model_validate(chat_request(req))
        except ValidationError as e:
            raise bad_request(f"input: {e.errors()[0]['msg']}", "input") from None
        rid = _id("resp")
        try:
            ctx, gen = await self.chat.prepare(chat, raw, rid, "input")
        except OpenAIError as e:
            e.param = PARAM_NAMES.get(e.param or "", e.param)
            raise
        shell = _Shell(req, rid, ctx.model, ctx.created)
        if req.stream:
            return StreamingResponse(
                self._stream(shell, ctx, gen),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(ctx.cleanup),
            )
        choices, usage = await ctx.collect_whole(gen)
        message = choices[0]["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(_reasoning(message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            logprobs = (choices[0].get("logprobs") or {}).get("content")
            cut = choices[0]["finish_reason"] == "length"  # the message ends where the limit cut it
            status = "incomplete" if cut else "completed"
            output.append(_message(message.get("content") or "", logprobs, status))
        output += [_function_call(c) for c in message.get("tool_calls") or []]
        body = shell.body(output, choices[0]["finish_reason"], _usage(usage))
        return Response(encode_json(body), media_type="application/json")

    async def _stream(self, shell: _Shell, ctx: Any, gen: Any) -> AsyncIterator[bytes]:
        events = _Events(shell)
        try:
            yield events.emit("response.created", response=shell.body([], None, None))
            yield events.emit("response.in_progress", response=shell.body([], None, None))
            reason, usage = None, None
            async for chunk in ctx.events(gen):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    for out in events.delta(delta, choice.get("logprobs")):
                        yield out
                    reason = choice["finish_reason"] or reason
            for out in events.finish("incomplete" if reason == "length" else "completed"):
                yield out
            kind = "response.incomplete" if reason == "length" else "response.completed"
            yield events.emit(kind, response=shell.body(events.items, reason, _usage(usage)))
        except (OpenAIError, ValueError, EngineDeadError) as e:
            err = e if isinstance(e, OpenAIError) else (
                value_error(e) if isinstance(e, ValueError) else engine_dead(str(e)))  # fmt: skip
            yield events.emit("error", code=err.code or err.type, message=err.message,
                              param=err.param)  # fmt: skip
        finally:
            ctx.log()


class _Shell:
    """The response object's fields beside its output (echoed from the request)."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, created: int) -> None:
        self.req, self.rid, self.model, self.created = req, rid, model, created

    def body(
        self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        req = self.req
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        fmt = req.text.format if req.text and req.text.format else None
        choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p,
            "truncation": req.truncation,
            "usage": usage,
            "user": req.user,
        }


class _Events:
    """Chat deltas in, Responses events out: which output item is open and what it holds."""

    def __init__(self, shell: _Shell) -> None:
        self.shell = shell
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode_json(data) + b"\n\n"

    def _index(self) -> int:
        return len(self.items)

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        self.open, self.text, self.logprobs = item, "", []
        out = [self.emit("response.output_item.added", output_index=self._index(), item=item)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.emit("response.content_part.added", item_id=item["id"],
                                 output_index=self._index(), content_index=0, part=part))  # fmt: skip
        return out

    def close_open(self, status: str = "completed") -> list[bytes]:
        """Finish the open item (a message's ``status``: ``incomplete`` where the output limit
        cut it): its ``.done`` events, then ``output_item.done``."""
        item = self.open
        if item is None:
            return []
        at, iid = self._index(), item["id"]
        if item["type"] == "reasoning":
            item = _reasoning(self.text) | {"id": iid}
            out = [self.emit("response.reasoning_text.done", item_id=iid, output_index=at,
                             content_index=0, text=self.text)]  # fmt: skip
        else:
            item = _message(self.text, self.logprobs, status) | {"id": iid}
            part = item["content"][0]
            out = [
                self.emit("response.output_text.done", item_id=iid, output_index=at,
                          content_index=0, text=self.text, logprobs=self.logprobs),
                self.emit("response.content_part.done", item_id=iid, output_index=at,
                          content_index=0, part=part),
            ]  # fmt: skip
        out.append(self.emit("response.output_item.done", output_index=at, item=item))
        self.items.append(item)
        self.open = None
        return out

    def finish(self, status: str) -> list[bytes]:
        """Close the open item; an output of nothing at all is one empty message (as whole)."""
        out = self._start(_message("", [], "in_progress")) if not self.items and not self.open else []
        return out + self.close_open(status)

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close_open()
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                    "status": "in_progress"} if kind == "reasoning" else {
                    "type": "message", "id": _id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
            out += self._start(item)
        assert self.open is not None
        self.text += text
        self.logprobs += logprobs
        iid, at = self.open["id"], self._index()
        if kind == "reasoning":
            out.append(self.emit("response.reasoning_text.delta", item_id=iid, output_index=at,
                                 content_index=0, delta=text))  # fmt: skip
        else:
            out.append(self.emit("response.output_text.delta", item_id=iid, output_index=at,
                                 content_index=0, delta=text, logprobs=logprobs))  # fmt: skip
        return out

    def delta(self, delta: dict[str, Any], logprobs: dict[str, Any] | None) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"], [])
        lps = (logprobs or {}).get("content") or []
        if delta.get("content") or lps and not delta.get("tool_calls"):
            out += self._text("message", delta.get("content") or "", lps)
        for call in delta.get("tool_calls") or []:
            out += self.close_open()
            item = _function_call(call)
            at = self._index()
            added = item | {"arguments": "", "status": "in_progress"}
            args = item["arguments"]
            out += [
                self.emit("response.output_item.added", output_index=at, item=added),
                self.emit("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=at, delta=args),
                self.emit("response.function_call_arguments.done", item_id=item["id"],
                          output_index=at, arguments=args),
                self.emit("response.output_item.done", output_index=at, item=item),
            ]  # fmt: skip
            self.items.append(item)
        return out
