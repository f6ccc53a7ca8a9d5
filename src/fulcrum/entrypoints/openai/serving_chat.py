"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fulcrum.engine.async_engine import EngineDeadError
from fulcrum.engine.outputs import RequestOutput
from fulcrum.entrypoints.openai.chat_template import (
    ChatTemplateError,
    render_chat_async,
    special_tokens_of,
)
from fulcrum.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead, value_error
from fulcrum.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from fulcrum.entrypoints.openai.serving_base import (
    OpenAIServing,
    conversation_id,
    openai_finish_reason,
    respond,
    run_until_disconnect,
    usage_dict,
)
from fulcrum.entrypoints.openai.sse import DONE, chat_logprobs, encode_json, sse_error, sse_event

_LONG_TEXT = 16_384  # characters; longer prompts are tokenized off the event loop


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


class ServingChat(OpenAIServing):
    endpoint = "chat"

    def template_for(self, req: ChatCompletionRequest) -> str:
        self.need_tokenizer("Chat (messages are text)", "messages")
        if req.chat_template is not None:
            if not self.opts.trust_request_chat_template:
                raise bad_request(
                    "chat_template: this server does not accept request-supplied chat templates "
                    "(start it with --trust-request-chat-template).",
                    "chat_template",
                )
            return req.chat_template
        template = self.opts.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise bad_request("messages: the model has no chat template.", "messages")
        return template

    async def render(
        self, req: ChatCompletionRequest, messages: list[dict[str, Any]]
    ) -> tuple[str, list[int]]:
        """Rendered prompt text and its token ids (the template holds the special tokens).

        The template renders in its own bounded thread (chat_template.py); long prompts are
        tokenized off the event loop too."""
        template = self.template_for(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true.",
                "continue_final_message",
            )
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs an assistant message last.", "continue_final_message"
            )
        kwargs = dict(req.chat_template_kwargs or {})
        try:
            text = await render_chat_async(
                template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                special_tokens=special_tokens_of(self.tokenizer),
                extra=kwargs,
            )
        except ChatTemplateError as e:
            raise value_error(e) from None
        if req.continue_final_message:
            last = messages[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        if len(text) > _LONG_TEXT:
            ids = await asyncio.to_thread(self._encode, text)
        else:
            ids = self._encode(text)
        return text, ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        self.check_common(req)
        if req.tools:
            raise bad_request("tools are not supported.", "tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request("response_format: only type 'text' is supported.", "response_format")
        if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        messages = messages_as_dicts(req.messages)
        text, ids = await self.render(req, messages)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.resolve_max_tokens(len(ids), requested, None, "messages")
        top_n = req.top_logprobs or 0
        params = self.sampling_params(req, max_tokens, top_n if req.logprobs else None)
        self.check_admission(1)
        rid = self.new_request_id("chatcmpl")
        gen = self.engine.generate(
            rid,
            ids,
            params,
            prompt=text,
            arrival_time=arrival,
            cache_salt=req.cache_salt,
            stream=req.stream,
        )
        ctx = _ChatCtx(self, req, raw, rid, model, ids, text, messages, arrival, top_n)
        return await respond(ctx, gen, req.stream)


class _ChatCtx:
    """One chat request's response assembly (streamed or whole)."""

    def __init__(
        self,
        serving: ServingChat,
        req: ChatCompletionRequest,
        raw: Request,
        rid: str,
        model: str,
        ids: list[int],
        text: str,
        messages: list[dict[str, Any]],
        arrival: float,
        top_n: int,
    ) -> None:
        self.s, self.req, self.raw, self.rid, self.model = serving, req, raw, rid, model
        self.ids, self.text, self.messages, self.arrival, self.top_n = (
            ids,
            text,
            messages,
            arrival,
            top_n,
        )
        self.created = int(arrival)
        self.fp = serving.state.system_fingerprint
        self.logged = False
        self.final: RequestOutput | None = None
        self.first_token_time: float | None = None
        self.num_output = 0
        self.finish_reason: str | None = None

    async def cleanup(self) -> None:
        """Abort whatever is still running (client gone before or while streaming); log once."""
        for rid in [self.rid]:
            self.s.engine.abort(rid)
        if not self.logged:
            self._log()

    def _log(self) -> None:
        self.logged = True
        self.s.log_request(
            request_id=self.rid,
            model=self.model,
            prompt_token_ids=self.ids,
            prompt=None,
            messages=self.messages,
            arrival_time=self.arrival,
            final=self.final,
            first_token_time=self.first_token_time,
            num_output_tokens=self.num_output,
            finish_reason=self.finish_reason or "abort",
            cache_salt=self.req.cache_salt,
            conversation_id=conversation_id(self.raw, self.req.user),
        )

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fp,
            "choices": choices,
        }
        if include_usage:
            c["usage"] = None
        return c

    async def stream(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        req = self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finished: set[int] = set()
        cached = 0
        try:
            for i in range(req.n):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                yield sse_event(self._chunk([choice], include_usage))
            async for ro in gen:
                cached = ro.num_cached_tokens or cached
                if ro.finished:
                    self.final = ro
                choices = []
                for c in ro.outputs:
                    if c.index in finished:
                        continue
                    self.num_output += len(c.token_ids)
                    if c.token_ids and self.first_token_time is None:
                        self.first_token_time = time.time()
                    reason = openai_finish_reason(c.finish_reason)
                    if not c.text and reason is None and not (req.logprobs and c.token_ids):
                        continue
                    lp = None
                    if req.logprobs:
                        lp = {
                            "content": chat_logprobs(
                                c.token_ids, c.logprobs, self.top_n, self.s.tokenizer
                            )
                        }
                    delta = {"content": c.text} if c.text else {}
                    choices.append(
                        {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
                    )
                    if reason is not None:
                        finished.add(c.index)
                        self.finish_reason = self.finish_reason or reason
                if choices:
                    yield sse_event(self._chunk(choices, include_usage))
            if include_usage:
                usage = usage_dict(len(self.ids), self.num_output, cached)
                yield sse_event({**self._chunk([], False), "usage": usage})
        except OpenAIError as e:
            yield sse_error(e)
        except ValueError as e:
            yield sse_error(value_error(e))
        except EngineDeadError as e:
            yield sse_error(engine_dead(str(e)))
        finally:
            self._log()
        yield DONE

    async def _collect(self, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        last: RequestOutput | None = None
        async for ro in gen:
            last = ro
        assert last is not None
        return last

    async def full(self, gen: AsyncIterator[RequestOutput]) -> Response:
        try:
            final = await run_until_disconnect(self.raw, self._collect(gen))
        except BaseException as e:
            await self.cleanup()
            if isinstance(e, EngineDeadError):
                raise engine_dead(str(e)) from None
            if isinstance(e, ValueError):
                raise value_error(e) from None
            raise
        self.final = final
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            reason = openai_finish_reason(c.finish_reason) or "stop"
            self.num_output += len(c.token_ids)
            lp = None
            if self.req.logprobs:
                lp = {
                    "content": chat_logprobs(c.token_ids, c.logprobs, self.top_n, self.s.tokenizer)
                }
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            )
        self.finish_reason = choices[0]["finish_reason"] if choices else None
        self._log()
        body = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fp,
            "choices": choices,
            "usage": usage_dict(len(self.ids), self.num_output, final.num_cached_tokens),
        }
        return Response(encode_json(body), media_type="application/json")
