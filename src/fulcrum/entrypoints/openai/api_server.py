"""The FastAPI app: routes, lifespan (engine start/stop) and the draining uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fulcrum import __version__
from fulcrum.engine.async_engine import AsyncEngine, EngineDeadError
from fulcrum.entrypoints.openai import errors as E
from fulcrum.entrypoints.openai import openapi
from fulcrum.entrypoints.openai.chat_template import ChatTemplateError
from fulcrum.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from fulcrum.entrypoints.openai.middleware import ServerGuard
from fulcrum.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from fulcrum.entrypoints.openai.request_log import RequestLog
from fulcrum.entrypoints.openai.responses_protocol import ResponsesRequest
from fulcrum.entrypoints.openai.serving_base import ClientDisconnected, ServerState
from fulcrum.entrypoints.openai.serving_chat import ServingChat, messages_as_dicts
from fulcrum.entrypoints.openai.serving_completions import ServingCompletions
from fulcrum.entrypoints.openai.serving_embeddings import ServingPooling
from fulcrum.entrypoints.openai.serving_lora import ServingLoRA
from fulcrum.entrypoints.openai.serving_responses import ServingResponses

logger = logging.getLogger(__name__)

EngineFactory = Callable[[ServerMetrics], Awaitable[AsyncEngine]]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}


def build_app(state: ServerState, engine_factory: EngineFactory) -> FastAPI:
    """The API app; ``engine_factory`` builds the engine in the server's event loop."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.metrics = ServerMetrics(state.model_name)
        if state.options.log_requests_file:
            state.request_log = RequestLog(state.options.log_requests_file)
        state.engine = await engine_factory(state.metrics)
        engine = state.engine
        if hasattr(engine, "lora_adapters"):  # one dict, kept current by the engine core
            engine.lora_adapters.update(state.options.lora_adapters)
            state.options.lora_adapters = engine.lora_adapters
        state.metrics.in_flight_source = lambda: engine.num_in_flight
        logger.info("engine ready: max_model_len=%d", state.engine.max_model_len)
        # What start-up built (the app, the tokenizer's tables, imported modules) lives as long
        # as the process: keep it out of the collector's full scans, which otherwise stall every
        # stream for hundreds of milliseconds under load.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await state.engine.shutdown()
            if state.request_log is not None:
                state.request_log.close()

    app = FastAPI(title="fulcrum", version=__version__, lifespan=lifespan)
    E.install_error_handlers(app)
    chat = ServingChat(state)
    completions = ServingCompletions(state)
    responses = ServingResponses(chat)
    pooling = ServingPooling(state)
    loras = ServingLoRA(state)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return E.error_response(E.engine_dead(str(exc)))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": openapi.SSE}},
    )
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": openapi.SSE}},
    )
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.post("/v1/responses", responses={**_ERRORS, 200: {"content": openapi.SSE}})
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(body, raw)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await pooling.embeddings(body, raw)

    @app.post("/classify", response_model=ClassificationResponse, responses=_ERRORS)
    async def classify(body: ClassificationRequest, raw: Request) -> Response:
        return await pooling.classify(body, raw)

    @app.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
    @app.post("/score", response_model=ScoreResponse, responses=_ERRORS, include_in_schema=False)
    async def score(body: ScoreRequest, raw: Request) -> Response:
        return await pooling.score(body, raw)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
    @app.post("/rerank", response_model=RerankResponse, responses=_ERRORS, include_in_schema=False)
    @app.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS, include_in_schema=False)
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        return await pooling.rerank(body, raw)

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=openapi.LORA_UPDATE)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        """Serve a PEFT adapter from the server's disk under a model name
        (``--allow-runtime-lora-updates``)."""
        return await loras.load(body)

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=openapi.LORA_UPDATE)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter; requests already running it finish."""
        return await loras.unload(body)

    def model_card(name: str) -> ModelCard:
        assert state.engine is not None
        opts = state.options
        adapter = opts.lora_adapters.get(name)
        return ModelCard(
            id=name,
            created=state.started_at,
            root=adapter or opts.model_root,
            parent=opts.served_model_names[0] if adapter else None,
            max_model_len=state.engine.max_model_len,
        )

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        names = [*state.options.served_model_names, *state.options.lora_adapters]
        return ModelList(data=[model_card(n) for n in names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str) -> ModelCard:
        opts = state.options
        if model not in opts.served_model_names and model not in opts.lora_adapters:
            raise E.model_not_found(model)
        return model_card(model)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise E.bad_request("Give exactly one of prompt or messages.", "prompt")
        tok = chat.need_tokenizer("/tokenize", "prompt" if body.prompt is not None else "messages")
        if body.messages is not None:
            if not body.messages:
                raise E.bad_request("messages must not be empty.", "messages")
            req = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
            try:
                _, ids = await chat.render(req, messages_as_dicts(body.messages))
            except ChatTemplateError as e:
                raise E.value_error(e) from None
        else:
            ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        assert state.engine is not None
        return TokenizeResponse(
            count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        chat.check_model(body.model)
        chat.check_token_ids(body.tokens, "tokens")
        tok = chat.need_tokenizer("/detokenize", "tokens")
        return DetokenizeResponse(prompt=str(tok.decode(body.tokens)))

    @app.get("/health", response_class=Response, responses=openapi.HEALTH)
    async def health() -> Response:
        """Liveness: 200 while the engine process is alive (also while draining)."""
        if state.engine is None or state.engine.dead is not None:
            return E.error_response(E.engine_dead())
        return Response(status_code=200)

    @app.get("/ready", response_class=JSONResponse, responses=openapi.READY)
    async def ready() -> Response:
        """Readiness: the model is loaded and the server is not draining."""
        if state.draining:
            return E.error_response(E.draining())
        if state.engine is None or state.engine.dead is not None:
            return E.error_response(E.engine_dead())
        return JSONResponse({"status": "ready", "model": state.model_name})

    @app.get("/metrics", response_class=Response, responses=openapi.METRICS)
    async def metrics() -> Response:
        if state.engine is not None:
            state.metrics.num_in_flight = state.engine.num_in_flight
            state.engine.request_stats()  # fresh numbers for the next scrape
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_class=JSONResponse, responses=openapi.VERSION)
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    app.add_middleware(ServerGuard, state=state)
    if state.options.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it runs first: a browser's preflight carries no API key.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.options.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    openapi.install(app, state)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains instead of exiting at once.

    Draining: new requests get 503 (the socket stays open to say so), in-flight requests run
    to completion for up to ``shutdown_timeout`` seconds, the rest are aborted; then uvicorn
    shuts down, the lifespan stops the engine process, and the process exits 0.
    A second signal exits immediately.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    engine_died = False  # the server stopped because the engine died: exit non-zero

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(self._exit_when_engine_dies())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    async def _exit_when_engine_dies(self, grace_s: float = 2.0) -> None:
        """A dead engine (a crashed core, a failed tensor-parallel rank) cannot come back:
        requests get 503 for ``grace_s``, then the server stops so a supervisor restarts it."""
        while not self.should_exit:
            await asyncio.sleep(0.2)
            engine = self.state.engine
            if engine is not None and engine.dead is not None:
                logger.error("engine died (%s); stopping the server in %.0f s", engine.dead, grace_s)
                await asyncio.sleep(grace_s)
                self.engine_died = self.should_exit = True
                return

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None or not self.started:
            self.should_exit = True
            if self.state.draining:
                self.force_exit = True
            return
        logger.info(
            "signal %s: draining for up to %.0f s",
            signal.Signals(sig).name,
            self.state.options.shutdown_timeout,
        )
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.options.shutdown_timeout
        while self.state.in_flight_http > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        engine = self.state.engine
        if engine is not None and engine.num_in_flight:
            logger.warning("shutdown timeout: aborting %d request(s)", engine.num_in_flight)
            engine.abort_all("The server shut down before the request finished.")
            await asyncio.sleep(0.2)  # let the streams send their error chunk
        self.should_exit = True
