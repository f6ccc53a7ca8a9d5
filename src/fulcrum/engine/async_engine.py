"""AsyncEngine: the server's asyncio face of an engine core running in its own process.

```
 generate() ──▶ OutputProcessor.add_request ──▶ CoreClient.add_request ──ipc──▶ core process
     ▲                                                                              │
 per-request asyncio.Queue ◀── output handler task ◀── process_outputs ◀── CoreClient.get_output
                                    └── aborts stop-string matches and disconnected requests
```

``generate`` yields ``RequestOutput`` objects: deltas for ``stream=True``, one cumulative output
at finish otherwise. Leaving the iterator early (client disconnect, cancellation) aborts the
request in the core, which frees its KV blocks and batch slot in the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fulcrum.engine.core_client import CoreClient
from fulcrum.engine.core_messages import (
    CallResult,
    CoreCall,
    CoreDead,
    CoreFactory,
    CoreUnreachableError,
    LoRAAdapters,
    RequestError,
)
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.engine.outputs import RequestMetrics, RequestOutput
from fulcrum.engine.step_trace import StepTrace
from fulcrum.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    to_wire,
)
from fulcrum.sampling_params import SamplingParams, tokenize_bad_words

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The core process is gone; every in-flight and future request fails with this."""


class StatsSink(Protocol):
    """Receives the engine's observations (``ServerMetrics`` implements it)."""

    def on_stats(self, stats: SchedulerStats) -> None: ...
    def on_prompt(self, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, num_new_tokens: int) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_inter_token(self, itl_s: float) -> None: ...
    def on_finished(
        self,
        finish_reason: str,
        e2e_s: float,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
    ) -> None: ...


@dataclass
class _RequestState:
    arrival_time: float
    num_prompt_tokens: int
    num_seqs: int  # n: the scheduler runs each choice as its own sequence
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class AsyncEngine:
    """Asyncio frontend of one engine-core process."""

    def __init__(
        self,
        client: CoreClient,
        processor: OutputProcessor,
        *,
        tokenizer: Any = None,
        max_model_len: int,
        vocab_size: int,
        stats_sink: StatsSink | None = None,
        model_config: Any = None,
    ) -> None:
        self.client = client
        self.processor = processor
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats_sink = stats_sink
        self.stats = SchedulerStats()
        self._last_step_end = 0.0  # core timestamp of the previous outputs message
        self.dead: str | None = None
        self._states: dict[str, _RequestState] = {}
        self._task: asyncio.Task[None] | None = None
        # the LoRA adapters served (name -> directory), kept current by the core's updates; the
        # server shares this dict with its options
        self.lora_adapters: dict[str, str] = {}
        self._calls: dict[int, asyncio.Future[CallResult]] = {}
        self._next_call = 0
        index = getattr(client, "index", 0)
        self._trace = StepTrace.from_env(f"api{index}" if index else "api")

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def start(
        cls,
        factory: CoreFactory,
        processor_factory: Any,
        *,
        tokenizer: Any = None,
        load_tokenizer: Callable[[], Any] | None = None,
        max_model_len: int = 0,
        vocab_size: int = 0,
        stats_sink: StatsSink | None = None,
        model_config: Any = None,
        startup_timeout: float = 600.0,
        client: CoreClient | None = None,
    ) -> AsyncEngine:
        """Spawn the core process (or use ``client``, attached to a core another process
        started), wait for its handshake (loading the tokenizer meanwhile, if ``load_tokenizer``
        is given) and start the output handler."""
        if client is None:
            client = CoreClient(factory)
            client.start()
        try:
            if load_tokenizer is not None:
                tokenizer, ready = await asyncio.gather(
                    asyncio.to_thread(load_tokenizer), client.wait_ready(startup_timeout)
                )
            else:
                ready = await client.wait_ready(startup_timeout)
        except BaseException:
            client.shutdown()
            raise
        engine = cls(
            client,
            processor_factory(tokenizer),
            tokenizer=tokenizer,
            max_model_len=ready.max_model_len or max_model_len,
            vocab_size=ready.vocab_size or vocab_size,
            stats_sink=stats_sink,
            model_config=model_config,
        )
        engine.stats = SchedulerStats(
            num_blocks_total=ready.num_blocks_total, num_blocks_free=ready.num_blocks_total
        )
        if stats_sink is not None:
            stats_sink.on_stats(engine.stats)
        engine._task = asyncio.get_running_loop().create_task(engine._output_loop())
        return engine

    @classmethod
    async def from_engine_config(
        cls, config: Any, *, stats_sink: StatsSink | None = None, client: CoreClient | None = None
    ) -> AsyncEngine:
        """Start on a resolved EngineConfig (``EngineArgs.create_engine_config()``); the core
        process loads the model while this process loads the tokenizer."""
        from fulcrum.engine.core_process import EngineCoreFactory
        from fulcrum.model.loader.tokenizer import load_tokenizer

        mc = config.model_config
        return await cls.start(
            EngineCoreFactory(config),
            OutputProcessor,
            load_tokenizer=functools.partial(load_tokenizer, mc),
            max_model_len=mc.max_model_len,
            vocab_size=mc.vocab_size,
            stats_sink=stats_sink,
            model_config=mc,
            client=client,
        )

    async def shutdown(self) -> None:
        """Stop the output handler and the core process (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await asyncio.to_thread(self.client.shutdown)
        if self._trace is not None:
            self._trace.close()
        self._fail_all(EngineDeadError("the engine is shut down."))

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    @property
    def num_seqs_in_flight(self) -> int:
        """Sequences submitted and not yet finished (a request with n choices counts n)."""
        return sum(s.num_seqs for s in self._states.values())

    @property
    def core_pid(self) -> int | None:
        return self.client.pid

    def request_stats(self) -> None:
        """Ask the core for fresh SchedulerStats (they arrive through the output handler)."""
        if self.dead is None:
            self.client.request_stats()

    # ------------------------------------------------------------------ requests
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        stream: bool = True,
        priority: int = 0,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request now; the returned iterator yields its outputs until it finishes.

        Submission is immediate (so admission counts are exact); ``EngineDeadError`` is raised
        here if the core process is gone. Iterating raises ``ValueError`` if the core refuses the
        request. Closing or cancelling the iterator early aborts the request.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in flight.")
        arrival = arrival_time if arrival_time is not None else time.time()
        if params.bad_words and not params.bad_words_token_ids:
            tokenize_bad_words(params, self.tokenizer)
        max_tokens = params.max_tokens or max(self.max_model_len - len(prompt_token_ids), 1)
        state = _RequestState(arrival, len(prompt_token_ids), params.n)
        self._states[request_id] = state
        self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival, stream)
        self._submit(
            request_id,
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=to_wire(params, max_tokens),
                arrival_time=arrival,
                cache_salt=cache_salt,
                priority=priority,
                lora=lora,
            ),
        )
        if self.stats_sink is not None:
            self.stats_sink.on_prompt(len(prompt_token_ids))
        return self._stream(request_id, state)

    async def _stream(self, request_id: str, state: _RequestState) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core no longer holds it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _submit(self, request_id: str, req: EngineCoreRequest) -> None:
        try:
            self.client.add_request(req)
        except CoreUnreachableError as e:
            self._states.pop(request_id, None)
            self.processor.abort_request(request_id)
            raise EngineDeadError(str(e)) from None

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); it counts as finished for "abort"."""
        st = self._states.pop(request_id, None)
        if st is None:
            return
        if self.stats_sink is not None:
            now = time.time()
            sched = st.first_scheduled_time
            queue_s = None if sched is None else sched - st.arrival_time
            self.stats_sink.on_finished(
                "abort", now - st.arrival_time, queue_s, st.num_prompt_tokens, st.num_output_tokens
            )
        with contextlib.suppress(Exception):
            self.processor.abort_request(request_id)
        if self.dead is None:
            self.client.abort_requests([request_id])

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; their iterators raise ``EngineDeadError(reason)``."""
        ids = list(self._states)
        for rid in ids:
            with contextlib.suppress(Exception):
                self.processor.abort_request(rid)
        self._fail_all(EngineDeadError(reason))
        if ids and self.dead is None:
            self.client.abort_requests(ids)

    async def call_core(self, method: str, *args: str, timeout: float = 600.0) -> None:
        """Run one of the core's ``CORE_CALLS`` between its steps. Raises ValueError (a bad
        argument, naming the field), LookupError (nothing of that name), RuntimeError (it
        failed) or EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(f"engine core died: {self.dead}")
        self._next_call += 1
        call_id = self._next_call
        fut: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            try:
                self.client.call(CoreCall(call_id, method, list(args)))
            except CoreUnreachableError as e:
                raise EngineDeadError(str(e)) from None
            res = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if res.error is not None:
            kind = {"value": ValueError, "not_found": LookupError}.get(res.kind, RuntimeError)
            raise kind(res.error)

    # ------------------------------------------------------------------ output handler
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = await self.client.get_output()
                if isinstance(msg, CoreDead):
                    logger.error("engine core died: %s", msg.message)
                    self.dead = msg.message
                    self._fail_all(EngineDeadError(f"engine core died: {msg.message}"))
                    return
                if isinstance(msg, RequestError):
                    self._fail_request(msg)
                    continue
                if isinstance(msg, CallResult):
                    fut = self._calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                    continue
                if isinstance(msg, LoRAAdapters):  # in place: the server's options share it
                    self.lora_adapters.clear()
                    self.lora_adapters.update(msg.adapters)
                    continue
                self._handle_outputs(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not hang every client
            logger.exception("output handler failed")
            self.dead = f"output handler failed: {e!r}"
            self._fail_all(EngineDeadError(self.dead))

    def _handle_outputs(self, msg: EngineCoreOutputs) -> None:
        now = time.time()
        if self._trace is not None and msg.outputs:
            self._trace.record({"t": now, "lag": now - msg.timestamp, "out": len(msg.outputs)})
        if msg.outputs:
            self._observe(msg.outputs, now, self._last_step_end)
            request_outputs, to_abort = self.processor.process_outputs(msg.outputs)
            for ro in request_outputs:
                self._deliver(ro, now)
            if to_abort:
                self.client.abort_requests(list(to_abort))
        self._last_step_end = msg.timestamp or now
        if msg.stats is not None:
            self.stats = msg.stats
            if self.stats_sink is not None:
                self.stats_sink.on_stats(msg.stats)

    def _observe(self, outputs: list[EngineCoreOutput], now: float, step_start: float) -> None:
        """Token counters and latency samples. A request's first scheduling time comes from the
        core with its first token (older cores: the start of the step that produced it)."""
        sink = self.stats_sink
        seen: set[str] = set()
        for out in outputs:
            st = self._states.get(out.request_id)
            if st is None or not out.new_token_ids:
                continue
            st.num_output_tokens += len(out.new_token_ids)
            st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
            if sink is not None:
                sink.on_tokens(len(out.new_token_ids))
            if out.request_id in seen:
                continue  # n > 1: one latency sample per request per step
            seen.add(out.request_id)
            if st.first_token_time is None:
                sched = out.first_scheduled_time or step_start
                st.first_scheduled_time = min(max(st.arrival_time, sched), now)
                st.first_token_time = now
                if sink is not None:
                    sink.on_first_token(now - st.arrival_time)
            elif sink is not None and st.last_token_time is not None:
                sink.on_inter_token(now - st.last_token_time)
            st.last_token_time = now

    def _deliver(self, ro: RequestOutput, now: float) -> None:
        st = self._states.get(ro.request_id)
        if st is None:
            return  # aborted meanwhile
        if ro.finished:
            del self._states[ro.request_id]
            ro.metrics = RequestMetrics(
                arrival_time=st.arrival_time,
                first_scheduled_time=st.first_scheduled_time,
                first_token_time=st.first_token_time,
                last_token_time=st.last_token_time,
                finished_time=now,
            )
            if not ro.num_cached_tokens:
                ro.num_cached_tokens = st.num_cached_tokens
            if self.stats_sink is not None:
                reason = next((c.finish_reason for c in ro.outputs if c.finish_reason), "stop")
                sched = st.first_scheduled_time
                queue_s = None if sched is None else sched - st.arrival_time
                e2e_s, n_in, n_out = (
                    now - st.arrival_time,
                    st.num_prompt_tokens,
                    st.num_output_tokens,
                )
                self.stats_sink.on_finished(str(reason), e2e_s, queue_s, n_in, n_out)
        st.queue.put_nowait(ro)

    def _fail_request(self, err: RequestError) -> None:
        st = self._states.pop(err.request_id, None)
        with contextlib.suppress(Exception):
            self.processor.abort_request(err.request_id)
        if st is not None:
            kind = ValueError if err.is_value_error else RuntimeError
            st.queue.put_nowait(kind(err.message))

    def _fail_all(self, exc: BaseException) -> None:
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        states, self._states = self._states, {}
        for st in states.values():
            st.queue.put_nowait(exc)
