"""What chat and completions serving share: server options, model check, admission, lengths,
sampling parameters, disconnect handling and the request log."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from fulcrum import __version__
from fulcrum.engine.async_engine import AsyncEngine
from fulcrum.engine.outputs import RequestOutput
from fulcrum.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    model_not_found,
    too_many_requests,
    value_error,
)
from fulcrum.entrypoints.openai.limits import MAX_PROMPTS_PER_REQUEST
from fulcrum.entrypoints.openai.protocol import SamplingRequest
from fulcrum.entrypoints.openai.request_log import RequestLog, RequestRecord
from fulcrum.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    tokenize_bad_words,
    truncate_prompt,
)

T = TypeVar("T")


@dataclass
class ServeOptions:
    """Server knobs (the `fulcrum serve` flags that are not engine flags)."""

    served_model_names: list[str]
    model_root: str | None = None
    api_key: str | None = None
    public_endpoints: bool = False  # /metrics and the API docs open despite api_key
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # overrides the model's template
    tool_call_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: str | None = None  # None: the thinking stays in the content
    max_request_bytes: int = 8 * 1024 * 1024
    max_queued_requests: int = 1024
    max_num_seqs: int = 256
    max_n: int = 16
    max_logprobs: int = 20
    max_tokens_default: int | None = None  # chat output cap when a request sets none
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask for
    shutdown_timeout: float = 30.0
    log_requests_file: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> adapter directory


@dataclass
class ServerState:
    """Mutable state shared by the routes, the middleware and the drain logic."""

    options: ServeOptions
    engine: AsyncEngine | None = None
    metrics: Any = None  # ServerMetrics
    request_log: RequestLog | None = None
    draining: bool = False
    in_flight_http: int = 0
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.options.served_model_names[0]

    @property
    def system_fingerprint(self) -> str:
        h = hashlib.sha1(f"{self.options.model_root}|{__version__}".encode()).hexdigest()
        return f"fp_{h[:10]}"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await ``coro``; cancel it (aborting its request) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


_DONE = object()


async def merge_streams(
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as ``(prompt_index, output)``; cancels all on exit."""
    if len(gens) == 1:
        async for ro in gens[0]:
            yield 0, ro
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for ro in gen:
                queue.put_nowait((i, ro))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class OpenAIServing:
    """Checks and conversions shared by the generation endpoints."""

    endpoint = "completions"

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.opts = state.options

    @property
    def engine(self) -> AsyncEngine:
        assert self.state.engine is not None
        return self.state.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def need_tokenizer(self, what: str, param: str) -> Any:
        """The tokenizer, or a 400 naming ``what`` needs it (a model served without one)."""
        tok = self.tokenizer
        if tok is None:
            raise bad_request(
                f"{what} needs a tokenizer, and this model is served without one: send token "
                "ids, or restart the server with --tokenizer.",
                param,
            )
        return tok

    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.state.model_name
        if model not in self.opts.served_model_names and model not in self.opts.lora_adapters:
            raise model_not_found(model)
        return model

    def split_prompts(self, p: Any, param: str) -> list[tuple[str | None, list[int]]]:
        """A completions ``prompt`` or an embeddings ``input`` (a string, strings, token ids,
        lists of token ids) as (text or None, token ids) per prompt; 400 naming ``param``."""
        if isinstance(p, str):
            items: list[Any] = [p]
        elif not p:
            raise bad_request(f"{param} must not be empty.", param)
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if len(items) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(
                f"{param} holds at most {MAX_PROMPTS_PER_REQUEST} prompts, got {len(items)}.",
                param,
            )
        out: list[tuple[str | None, list[int]]] = []
        for item in items:
            if isinstance(item, str):
                tok = self.need_tokenizer(f"A text {param}", param)
                ids = list(tok(item, add_special_tokens=True)["input_ids"])
                out.append((item, ids))
            else:
                ids = list(item)
                self.check_token_ids(ids, param)
                out.append((None, ids))
        return out

    def check_generates(self) -> None:
        """A 400 naming ``model`` where the served model computes embeddings (runner
        pooling): it has no LM head to generate with."""
        if getattr(self.engine.model_config, "pooler_config", None) is not None:
            raise bad_request(
                "This model serves embeddings (runner pooling) and generates no text: use "
                "POST /v1/embeddings.",
                "model",
            )

    def check_admission(self, num_new_seqs: int, param: str = "n") -> None:
        """Count sequences (prompts x n): 429 when those waiting for a batch slot would exceed
        --max-queued-requests, 400 naming ``param`` when this request alone could never fit."""
        capacity = self.opts.max_num_seqs + self.opts.max_queued_requests
        if num_new_seqs > capacity:
            raise bad_request(
                f"This request asks for {num_new_seqs} sequences (prompts x n); the server "
                f"runs at most {self.opts.max_num_seqs} and queues at most "
                f"{self.opts.max_queued_requests} more.",
                param,
                "too_many_sequences",
            )
        if self.engine.num_seqs_in_flight + num_new_seqs > capacity:
            raise too_many_requests(self.opts.max_queued_requests)

    def check_common(self, req: SamplingRequest) -> None:
        if req.n > self.opts.max_n:
            raise bad_request(f"n must be at most {self.opts.max_n}, got {req.n}.", "n")
        self.logit_bias(req)
        if req.truncate_prompt_tokens == 0:
            raise bad_request(
                "truncate_prompt_tokens must be -1 or at least 1.", "truncate_prompt_tokens"
            )
        if req.allowed_token_ids is not None:
            if not req.allowed_token_ids:
                raise bad_request("allowed_token_ids must not be empty.", "allowed_token_ids")
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true.", "stream_options"
            )
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs is not available with stream.", "prompt_logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in req.stop_token_ids or []):
            raise bad_request(f"stop_token_ids must be in [0, {vocab}).", "stop_token_ids")

    def logit_bias(self, req: SamplingRequest) -> dict[int, float] | None:
        """The request's ``logit_bias`` with token ids as ints; 400 naming the entry at fault."""
        if not req.logit_bias:
            return None
        vocab, out = self.engine.vocab_size, {}
        for key, bias in req.logit_bias.items():
            tok = int(key) if key.strip().isdecimal() else -1
            if not 0 <= tok < vocab:
                raise bad_request(
                    f"logit_bias: key {key!r} is not a token id in [0, {vocab}).", "logit_bias"
                )
            if not -100 <= bias <= 100:
                raise bad_request(
                    f"logit_bias: the bias of token {key} must be in [-100, 100], got {bias}.",
                    "logit_bias",
                )
            out[tok] = bias
        return out

    def truncate_prompt(
        self, req: SamplingRequest, ids: list[int], max_tokens: int | None
    ) -> list[int]:
        return truncate_prompt(ids, req.truncate_prompt_tokens, self.engine.max_model_len, max_tokens)

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is not None and k > self.opts.max_logprobs:
            raise bad_request(f"{param} must be at most {self.opts.max_logprobs}, got {k}.", param)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is out of range [0, {vocab}).", param)

    def resolve_max_tokens(
        self, num_prompt: int, requested: int | None, default: int | None, where: str
    ) -> int:
        """Check prompt + output against the context and the server's cap. Without a request
        value: ``default``, else --max-tokens-default, else the remaining room."""
        limit = self.engine.max_model_len
        if num_prompt == 0:
            raise bad_request("The prompt is empty.", "prompt" if where == "prompt" else "messages")
        if num_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_prompt} input tokens, which leaves no room for output tokens. "
                f"Please reduce the length of the {where}.",
                "messages" if where == "messages" else "prompt",
                "context_length_exceeded",
            )
        room = limit - num_prompt
        cap = self.opts.max_tokens_limit
        if requested is None:
            fallback = default if default is not None else self.opts.max_tokens_default
            fallback = min(x for x in (fallback, cap, room) if x is not None)
            return fallback
        if cap is not None and requested > cap:
            raise bad_request(
                f"max_tokens must be at most {cap} on this server, got {requested}.",
                "max_tokens",
            )
        if requested > room:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the {where}, {requested} in "
                f"the completion). Please reduce the length of the {where} or completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        req: SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        top_k = req.top_k
        if top_k > self.engine.vocab_size:
            top_k = -1  # keeping the whole vocabulary is the same as no top-k
        try:
            params = SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=top_k,
                min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop_list(),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured,
                logit_bias=self.logit_bias(req),
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
            )
            tokenize_bad_words(params, self.tokenizer)
            return params
        except ValueError as e:
            raise value_error(e) from None

    def submit(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        arrival: float,
        req: SamplingRequest,
    ) -> AsyncIterator[RequestOutput]:
        """Hand one prompt to the engine; its outputs arrive through the returned iterator."""
        return self.engine.generate(
            request_id,
            ids,
            params,
            prompt=prompt,
            arrival_time=arrival,
            cache_salt=req.cache_salt,
            stream=req.stream,
            priority=req.priority,
            lora=req.model if req.model in self.opts.lora_adapters else None,
        )

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def log_request(
        self,
        *,
        request_id: str,
        model: str,
        prompt_token_ids: list[int],
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        arrival_time: float,
        final: RequestOutput | None,
        first_token_time: float | None,
        num_output_tokens: int,
        finish_reason: str | None,
        cache_salt: str | None,
        conversation_id: str | None,
    ) -> None:
        log = self.state.request_log
        if log is None:
            return
        now = time.time()
        metrics = final.metrics if final is not None else None
        if metrics is not None and metrics.first_token_time is not None:
            first_token_time = metrics.first_token_time
        if metrics is not None and metrics.finished_time is not None:
            now = metrics.finished_time
        log.write(
            RequestRecord(
                request_id=request_id,
                arrival_time=arrival_time,
                endpoint=self.endpoint,
                model=model,
                prompt_token_ids=prompt_token_ids,
                prompt=prompt,
                messages=messages,
                num_prompt_tokens=len(prompt_token_ids),
                num_output_tokens=num_output_tokens,
                num_cached_tokens=final.num_cached_tokens if final is not None else 0,
                ttft_s=None if first_token_time is None else first_token_time - arrival_time,
                e2e_s=now - arrival_time,
                finish_reason=finish_reason,
                cache_salt=cache_salt,
                conversation_id=conversation_id,
            )
        )


def conversation_id(request: Request, user: str | None) -> str | None:
    return request.headers.get("x-conversation-id") or user


def openai_finish_reason(reason: str | None) -> str | None:
    """Map the engine's finish reasons onto OpenAI's ("stop" | "length")."""
    if reason is None:
        return None
    if reason == "abort":
        raise OpenAIError("The request was aborted.", 503, "service_unavailable_error")
    return "length" if reason == "length" else "stop"


def usage_dict(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
