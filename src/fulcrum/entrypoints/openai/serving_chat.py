"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fulcrum.engine.outputs import CompletionOutput, RequestOutput
from fulcrum.entrypoints.openai.chat_template import (
    ChatTemplateError,
    render_chat_async,
    special_tokens_of,
)
from fulcrum.entrypoints.openai.errors import bad_request, value_error
from fulcrum.entrypoints.openai.messages import ChatMessage
from fulcrum.entrypoints.openai.protocol import ChatCompletionRequest
from fulcrum.entrypoints.openai.reasoning import ReasoningStream, get_reasoning_parser, marker_ids
from fulcrum.entrypoints.openai.serving_base import (
    OpenAIServing,
    conversation_id,
    openai_finish_reason,
    usage_dict,
)
from fulcrum.entrypoints.openai.serving_response import ResponseContext
from fulcrum.entrypoints.openai.sse import chat_logprobs, prompt_logprobs_json
from fulcrum.entrypoints.openai.structured_request import check_tool_schemas, structured_params
from fulcrum.entrypoints.openai.tool_calls import ToolCalls, ToolStream
from fulcrum.entrypoints.openai.tool_parsers import get_parser, parser_for_template
from fulcrum.entrypoints.openai.tool_prompt import (
    hermes_messages,
    template_renders_tools,
    tool_call_schema,
    tools_as_dicts,
    with_tool_arguments_as_objects,
)
from fulcrum.sampling_params import StructuredOutputsParams

_LONG_TEXT = 16_384  # characters; longer prompts are tokenized off the event loop


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.as_dict() for m in messages]


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
        self,
        req: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
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
        if tools:
            if template_renders_tools(template):
                kwargs["tools"] = tools
                messages = with_tool_arguments_as_objects(messages)
            else:
                messages = hermes_messages(messages, tools)
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
        ctx, gen = await self.prepare(req, raw)
        return await ctx.respond(gen, req.stream)

    async def prepare(
        self, req: ChatCompletionRequest, raw: Request, rid: str | None = None, where: str = "messages"
    ) -> tuple[_ChatCtx, AsyncIterator[RequestOutput]]:
        """Validate, render and submit: the response's context and the engine's outputs (the
        Responses API assembles its own body from the same two; ``where`` names the prompt's
        field in errors)."""
        arrival = time.time()
        model = self.check_model(req.model)
        self.check_generates()
        self.check_common(req)
        tools, tool_calls, forced = self._tools(req)
        structured = structured_params(req, forced)
        if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        messages = messages_as_dicts(req.messages)
        text, full = await self.render(req, messages, tools)
        requested = req.max_completion_tokens or req.max_tokens
        ids = self.truncate_prompt(req, full, requested)
        if len(ids) < len(full):
            text = None  # the rendered text no longer matches the ids
        max_tokens = self.resolve_max_tokens(len(ids), requested, None, where)
        if structured is not None and self.opts.reasoning_parser:
            structured = self._after_thinking(structured, ids)
        top_n = req.top_logprobs or 0
        params = self.sampling_params(
            req, max_tokens, top_n if req.logprobs else None, structured, req.prompt_logprobs
        )
        self.check_admission(req.n)
        rid = rid or self.new_request_id("chatcmpl")
        gen = self.submit(rid, ids, params, text, arrival, req)
        ctx = _ChatCtx(self, req, raw, rid, model, ids, text, messages, arrival, top_n)
        ctx.tool_calls = tool_calls
        return ctx, gen

    @functools.cached_property
    def _markers(self) -> tuple[int, int] | None:
        return marker_ids(self.tokenizer)

    def _after_thinking(
        self, structured: StructuredOutputsParams, ids: list[int]
    ) -> StructuredOutputsParams:
        """The constraint with its ``thinking`` gate: a reasoning model thinks freely first."""
        if self._markers is None:
            return structured
        parser = get_reasoning_parser(self.opts.reasoning_parser)  # type: ignore[arg-type]
        return dataclasses.replace(structured, thinking=parser.gate(self._markers, ids))

    def _tools(
        self, req: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]] | None, ToolCalls | None, dict[str, Any] | None]:
        """The tools to render, how to read calls back, and the constraint ``required`` or a
        named ``tool_choice`` puts on the output."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice: needs tools.", "tool_choice")
            return None, None, None
        tools = tools_as_dicts(req.tools)
        if choice == "none":
            return None, None, None
        name = None if isinstance(choice, str) or choice is None else choice.function.name
        check_tool_schemas(tools, enforced=choice == "required" or name is not None)
        if name is not None and name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice: no tool named {name!r} in tools.", "tool_choice")
        if choice == "required" or name is not None:
            schema = tool_call_schema(tools, name, req.parallel_tool_calls)
            return tools, ToolCalls(None, forced=True), {"json": schema}
        parser = self.opts.tool_call_parser or parser_for_template(self.template_for(req))
        names = frozenset(t["function"]["name"] for t in tools)
        return tools, ToolCalls(get_parser(parser), names=names), None


class _ChatCtx(ResponseContext):
    """One chat request's response assembly (streamed or whole)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        serving: ServingChat,
        req: ChatCompletionRequest,
        raw: Request,
        rid: str,
        model: str,
        ids: list[int],
        text: str | None,
        messages: list[dict[str, Any]],
        arrival: float,
        top_n: int,
    ) -> None:
        super().__init__(serving, req, raw, rid, model, arrival)
        self.req, self.ids, self.text, self.messages, self.top_n = req, ids, text, messages, top_n
        self.final: RequestOutput | None = None
        self.first_token_time: float | None = None
        self.num_output = 0
        self.finish_reason: str | None = None
        self.tool_calls: ToolCalls | None = None
        name = serving.opts.reasoning_parser
        self.reasoning = get_reasoning_parser(name) if name else None

    def request_ids(self) -> list[str]:
        return [self.rid]

    def log(self) -> None:
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

    def extra(self) -> dict[str, Any]:
        k = self.req.prompt_logprobs
        if k is None or self.final is None:
            return {}
        entries = self.final.prompt_logprobs
        return {"prompt_logprobs": prompt_logprobs_json(entries, k, self.s.tokenizer)}

    def _logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        as_ids = self.req.return_tokens_as_token_ids
        return {"content": chat_logprobs(c.token_ids, c.logprobs, self.top_n, self.s.tokenizer, as_ids)}

    async def events(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
        req = self.req
        finished: set[int] = set()
        streams: dict[int, ToolStream] = {}
        thinking: dict[int, ReasoningStream] = {}
        cached = 0
        for i in range(req.n):
            delta = {"role": "assistant", "content": ""}
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            yield self.chunk([choice])
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
                text, calls, reasoning = c.text, [], ""
                if self.reasoning is not None:  # the thinking first; the rest is content
                    rs = thinking.setdefault(c.index, ReasoningStream(self.reasoning))
                    reasoning, text = rs.feed(text)
                    if reason is not None:
                        more, rest = rs.finish()
                        reasoning, text = reasoning + more, text + rest
                if self.tool_calls is not None:
                    st = streams.setdefault(c.index, ToolStream(self.tool_calls))
                    text, calls = st.feed(text)
                    if reason is not None:
                        text += st.finish()
                        reason = "tool_calls" if st.has_calls and reason == "stop" else reason
                wants_ids = (req.logprobs or req.return_token_ids) and c.token_ids
                if not text and not calls and not reasoning and reason is None and not wants_ids:
                    continue
                if not req.include_reasoning:
                    reasoning = ""
                delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                choice = {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": self._logprobs(c),
                    "finish_reason": reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
                if reason is not None:
                    finished.add(c.index)
                    self.finish_reason = self.finish_reason or reason
            if choices:
                yield self.chunk(choices)
        if self.include_usage:
            yield self.usage_chunk(usage_dict(len(self.ids), self.num_output, cached))

    async def collect(self, gen: AsyncIterator[RequestOutput]) -> None:
        last: RequestOutput | None = None
        async for ro in gen:
            last = ro
        assert last is not None
        self.final = last

    def whole(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        final = self.final
        assert final is not None
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            reason = openai_finish_reason(c.finish_reason) or "stop"
            self.num_output += len(c.token_ids)
            reasoning, text = None, c.text
            if self.reasoning is not None:
                reasoning, text = self.reasoning.split(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tool_calls is not None:
                message, has_calls = self.tool_calls.message(text)
                reason = "tool_calls" if has_calls and reason == "stop" else reason
            if reasoning is not None:
                message["content"] = message["content"] or None
                if self.req.include_reasoning:
                    message["reasoning_content"] = reasoning
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c),
                "finish_reason": reason,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        self.finish_reason = choices[0]["finish_reason"] if choices else None
        return choices, usage_dict(len(self.ids), self.num_output, final.num_cached_tokens)
