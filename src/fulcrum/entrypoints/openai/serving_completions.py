"""POST /v1/completions (prompt: string, list of strings, token ids, list of token-id lists)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fulcrum.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from fulcrum.entrypoints.openai.errors import bad_request
from fulcrum.entrypoints.openai.protocol import CompletionRequest
from fulcrum.entrypoints.openai.serving_base import (
    OpenAIServing,
    conversation_id,
    merge_streams,
    openai_finish_reason,
    usage_dict,
)
from fulcrum.entrypoints.openai.serving_response import ResponseContext
from fulcrum.entrypoints.openai.sse import completion_logprobs, prompt_logprobs_json
from fulcrum.entrypoints.openai.structured_request import structured_params


@dataclass
class _Prompt:
    request_id: str
    text: str | None  # as given (None for token-id prompts)
    ids: list[int]
    first_token_time: float | None = None
    num_output: int = 0
    final: RequestOutput | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None  # echo + logprobs


class ServingCompletions(OpenAIServing):
    endpoint = "completions"

    def _check_text_needs(self, req: CompletionRequest) -> None:
        """Without a tokenizer, token ids in and out work; what shows or matches text cannot."""
        if req.stop_list():
            self.need_tokenizer("stop (stop strings; stop_token_ids work without one)", "stop")
        if req.logprobs is not None:
            self.need_tokenizer("logprobs (each token shown as text)", "logprobs")
        if req.echo:
            self.need_tokenizer("echo (the prompt as text)", "echo")

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        model = self.check_model(req.model)
        self.check_generates()
        self.check_common(req)
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking).", "best_of")
        self.check_logprobs(req.logprobs, "logprobs")
        self._check_text_needs(req)
        structured = structured_params(req)
        if structured is not None:
            self.need_tokenizer("structured_outputs (grammars are over text)", "structured_outputs")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens: 0 is only valid with echo (scoring the prompt).",
                              "max_tokens")  # fmt: skip
        # max_tokens 0 with echo: one token is computed (the engine always samples) and dropped
        wanted = 1 if req.max_tokens == 0 else req.max_tokens
        prompts = [
            (text if len(cut) == len(ids) else None, cut)  # a cut text would not match its ids
            for text, ids in self.split_prompts(req.prompt, "prompt")
            for cut in (self.truncate_prompt(req, ids, wanted),)
        ]
        resolved = [
            self.resolve_max_tokens(len(ids), wanted, 16, "prompt") for _, ids in prompts
        ]
        # echo + logprobs scores the prompt too (evaluation harnesses read its tokens' logprobs),
        # as does vLLM's prompt_logprobs: the engine computes the larger of the two
        asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        prompt_lp = max(asked) if asked else None
        params = [
            self.sampling_params(req, m, req.logprobs, structured, prompt_lp) for m in resolved
        ]
        n = max(req.n, req.best_of or 1)
        self.check_admission(len(prompts) * n, "prompt" if n == 1 else "n")
        base = self.new_request_id("cmpl")
        states = [
            _Prompt(f"{base}-{i}" if len(prompts) > 1 else base, text, ids)
            for i, (text, ids) in enumerate(prompts)
        ]
        gens = [
            self.submit(st.request_id, st.ids, p, st.text, arrival, req)
            for st, p in zip(states, params, strict=True)
        ]
        ctx = _CompletionCtx(self, req, raw, base, model, states, arrival)
        return await ctx.respond(gens, req.stream)


class _CompletionCtx(ResponseContext):
    """One completions request's response assembly: its prompts' choices, ``n`` per prompt."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self,
        serving: ServingCompletions,
        req: CompletionRequest,
        raw: Request,
        rid: str,
        model: str,
        prompts: list[_Prompt],
        arrival: float,
    ) -> None:
        super().__init__(serving, req, raw, rid, model, arrival)
        self.req, self.prompts = req, prompts
        self.top_n = req.logprobs or 0
        # Without a tokenizer the text is empty: the token ids are the output.
        self.with_ids = req.return_token_ids or serving.tokenizer is None

    def request_ids(self) -> list[str]:
        return [p.request_id for p in self.prompts]

    def log(self) -> None:
        self.logged = True
        for p in self.prompts:
            self.s.log_request(
                request_id=p.request_id,
                model=self.model,
                prompt_token_ids=p.ids,
                prompt=p.text,
                messages=None,
                arrival_time=self.arrival,
                final=p.final,
                first_token_time=p.first_token_time,
                num_output_tokens=p.num_output,
                finish_reason=p.finish_reason or "abort",
                cache_salt=self.req.cache_salt,
                conversation_id=conversation_id(self.raw, self.req.user),
            )

    def _echo_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        return str(self.s.tokenizer.decode(p.ids))

    def _shown(self, c: CompletionOutput) -> CompletionOutput:
        """The choice as the client asked for it: with max_tokens 0 (echo only) the token the
        engine computed is not part of it."""
        if self.req.max_tokens != 0:
            return c
        lps = [] if c.logprobs is not None else None
        return replace(c, text="", token_ids=[], logprobs=lps, cumulative_logprob=None)

    def _logprobs(self, p: _Prompt, c: CompletionOutput, offset: int, echo: bool) -> Any:
        if self.req.logprobs is None:
            return None
        return completion_logprobs(
            c.token_ids, c.logprobs, self.top_n, self.s.tokenizer, offset,
            p.ids if echo else None, p.prompt_logprobs if echo else None,
            self.req.return_tokens_as_token_ids,
        )  # fmt: skip

    def _usage(self) -> dict[str, Any]:
        cached = sum(p.final.num_cached_tokens for p in self.prompts if p.final is not None)
        return usage_dict(
            sum(len(p.ids) for p in self.prompts), sum(p.num_output for p in self.prompts), cached
        )

    async def events(
        self, gens: list[AsyncIterator[RequestOutput]]
    ) -> AsyncIterator[dict[str, Any]]:
        req, n = self.req, self.req.n
        finished: set[int] = set()
        offsets: dict[int, int] = {}
        async for pi, ro in merge_streams(gens):
            p = self.prompts[pi]
            if ro.finished:
                p.final = ro
            if ro.prompt_logprobs is not None:  # on the request's first output only
                p.prompt_logprobs = ro.prompt_logprobs
            choices = []
            for c in map(self._shown, ro.outputs):
                index = pi * n + c.index
                if index in finished:
                    continue
                p.num_output += len(c.token_ids)
                if c.token_ids and p.first_token_time is None:
                    p.first_token_time = time.time()
                reason = openai_finish_reason(c.finish_reason)
                first = index not in offsets
                echo = req.echo and first
                text = (self._echo_text(p) if echo else "") + c.text
                wants_ids = (req.logprobs is not None or self.with_ids) and c.token_ids
                if not text and reason is None and not wants_ids:
                    continue
                offsets.setdefault(index, 0)
                lp = self._logprobs(p, c, offsets[index], echo)
                offsets[index] += len(text)
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
                if self.with_ids:
                    choice["token_ids"] = list(c.token_ids)
                    if first:
                        choice["prompt_token_ids"] = p.ids
                choices.append(choice)
                if reason is not None:
                    finished.add(index)
                    p.finish_reason = p.finish_reason or reason
            if choices:
                yield self.chunk(choices)
        if self.include_usage:
            yield self.usage_chunk(self._usage())

    async def collect(self, gens: list[AsyncIterator[RequestOutput]]) -> None:
        async for pi, ro in merge_streams(gens):
            if ro.finished:
                self.prompts[pi].final = ro

    def whole(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        choices = []
        for pi, p in enumerate(self.prompts):
            assert p.final is not None
            p.prompt_logprobs = p.final.prompt_logprobs
            for c in sorted(map(self._shown, p.final.outputs), key=lambda c: c.index):
                reason = openai_finish_reason(c.finish_reason) or "stop"
                p.finish_reason = p.finish_reason or reason
                p.num_output += len(c.token_ids)
                prefix = self._echo_text(p) if self.req.echo else ""
                choice = {
                    "index": pi * self.req.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": self._logprobs(p, c, 0, self.req.echo),
                    "finish_reason": reason,
                }
                if self.with_ids:
                    choice["prompt_token_ids"] = p.ids
                    choice["token_ids"] = list(c.token_ids)
                if self.req.prompt_logprobs is not None:
                    k = self.req.prompt_logprobs
                    choice["prompt_logprobs"] = prompt_logprobs_json(p.prompt_logprobs, k, self.s.tokenizer)
                choices.append(choice)
        return choices, self._usage()
