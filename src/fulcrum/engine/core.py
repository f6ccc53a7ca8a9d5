"""EngineCore: the busy loop's body. ``step()`` = schedule → execute → update.

The core knows token ids only; text, stop strings and user-facing outputs are the frontend's.

With ``async_scheduling`` a step launches the next batch before it collects the last one, so
the host's bookkeeping runs while the device computes::

    host:    schedule N+1 │ launch N+1 │ wait N, update N, return N's tokens │ schedule N+2 ...
    device:  ......... step N ........│............. step N+1 ..............│ ...

Step N+1's inputs that step N samples stay on the device (the runner patches them in). With
structured output, step N+1's grammar bitmask needs step N's token: the runner launches N+1's
forward, then the core collects N (advancing the matchers) and fills the bitmask while the device
runs the forward, and only then is N+1 sampled. The core
falls back to one step at a time while a running request's sampling needs host-side history
(penalties, min_tokens), after a verify step, and while the next step may guess (speculation in
a batch no larger than ``disable_by_batch_size``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent import futures

from fulcrum.config import EngineConfig, LoRAConfig
from fulcrum.kv_cache.sliding_window import kv_free_window, layer_windows
from fulcrum.lora.registry import LoRARegistry
from fulcrum.model.loader.hf_config import generation_eos_token_ids
from fulcrum.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.scheduler.scheduler import Scheduler
from fulcrum.structured.manager import StructuredOutputManager
from fulcrum.worker.model_runner import ModelRunner
from fulcrum.worker.startup import prepare_runner
from fulcrum.worker.step_sampling import StepHandle

logger = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 0.05  # longest wait for a compile before the loop looks at its inputs again


def eos_token_ids(config: EngineConfig) -> set[int]:
    """The ids that end a sequence: ``config.json``'s EOS and ``generation_config.json``'s."""
    mc = config.model_config
    eos = getattr(mc.hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if mc.load_format == "dummy":  # configs/ holds many architectures' files side by side
        return ids
    return ids | generation_eos_token_ids(mc.weights_path, mc.tokenizer_path)


def engine_kv_window(config: EngineConfig) -> int | None:
    """The sliding window outside which the scheduler releases a request's KV blocks (None:
    some layer of the model, or of a draft model reading the same blocks, reads every key)."""
    models = (config.model_config, config.draft_model_config)
    return kv_free_window(
        *(layer_windows(m.hf_config, m.max_model_len) for m in models if m is not None)
    )


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        if config.parallel_config.tensor_parallel_size > 1:  # rank 0 here, the rest spawned
            from fulcrum.worker.tp_runner import start_driver

            self.runner, num_blocks = start_driver(config)
        else:
            self.runner = ModelRunner(config)
            num_blocks = prepare_runner(self.runner)
        sc = config.scheduler_config
        bs = config.cache_config.block_size
        if num_blocks * bs < sc.max_model_len:
            logger.warning(
                "The KV cache holds %d tokens, fewer than max_model_len=%d: capping max_model_len.",
                num_blocks * bs, sc.max_model_len,
            )
            sc = dataclasses.replace(sc, max_model_len=num_blocks * bs)
        self.max_model_len = sc.max_model_len
        eos = eos_token_ids(config)
        pooler = config.model_config.pooler_config
        self.structured = _structured_manager(config, eos)
        self.loras = LoRARegistry(config.lora_config)
        self.scheduler = Scheduler(
            sc, config.cache_config, num_blocks, config.model_config.vocab_size, eos,
            self.structured, config.speculative_config, kv_window=engine_kv_window(config),
            loras=self.loras,
            whole_prompt=pooler is not None and pooler.whole_prompt,
            unchunked=pooler is not None and pooler.bidirectional,
            host_blocks=self.runner.num_host_blocks,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max_model_len %d holds %.1f "
            "full-length sequences. Engine ready in %.2f s (weights %.2f s).",
            num_blocks, bs, num_blocks * bs, num_blocks * self.runner.bytes_per_block / 2**30,
            str(self.runner.kv_dtype).removeprefix("torch."),
            sc.max_model_len, num_blocks * bs / sc.max_model_len, time.perf_counter() - t0,
            self.runner.load_time,
        )
        self.num_steps = 0
        # (tokens, requests, newly scheduled requests) of the last step, for the step trace
        self.last_batch: tuple[int, int, int] = (0, 0, 0)
        self.async_scheduling = config.async_scheduling
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        self.num_overlapped_steps = 0  # steps scheduled before the previous one was collected

    @property
    def num_kv_tokens(self) -> int:
        return self.runner.num_blocks * self.config.cache_config.block_size

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` into a free slot under ``name`` (``runtime_updates``
        only); ValueError naming the field for anything that cannot be served."""
        self._check_lora_updates()
        LoRAConfig.check_name(name, "lora_name")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"lora_path: {path} is not a PEFT adapter directory (no "
                             "adapter_config.json).")  # fmt: skip
        slot = self.loras.free_slot(name, self.scheduler.holds_lora_slot)
        self.runner.load_lora(slot, name, path)
        self.loras.assign(slot, name, os.path.abspath(path))
        logger.info("LoRA adapter %r loaded into slot %d from %s", name, slot, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving the adapter ``name``: new requests naming it fail; those already running
        finish with it, and its slot is reused after them."""
        self._check_lora_updates()
        if name not in self.loras.adapters():
            served = ", ".join(self.loras.adapters()) or "none"
            raise LookupError(f"lora_name: no adapter named {name!r} is loaded (served: {served}).")
        slot = self.loras.remove(name)
        logger.info("LoRA adapter %r unloaded (slot %d)", name, slot)

    def _check_lora_updates(self) -> None:
        if not self.config.lora_config.runtime_updates:
            raise ValueError("allow_runtime_lora_updates is off: adapters are fixed at start; "
                             "start the engine with it (--allow-runtime-lora-updates) to load "
                             "and unload them while serving.")  # fmt: skip

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> EngineCoreOutputs:
        prev, self._inflight = self._inflight, None
        outputs: list[EngineCoreOutput] = []
        if prev is not None and not self._may_overlap(prev[0]):
            outputs += self._collect(prev)
            prev = None
        elif prev is not None:
            self.num_overlapped_steps += 1
        sched_out = self.scheduler.schedule()
        self.last_batch = (
            sched_out.num_batched_tokens,
            len(sched_out.num_scheduled_tokens),
            len(sched_out.scheduled_new_reqs),
        )
        if not sched_out.is_empty:
            fill: Callable[[], None] | None = None
            if self.scheduler.needs_bitmask(sched_out):

                def fill_bitmask() -> None:
                    # Runs while the device computes this step's forward: the previous step's
                    # tokens advance the matchers, then this step's bitmask is filled.
                    nonlocal prev
                    if prev is not None:
                        outputs.extend(self._collect(prev))
                        prev = None
                    self.scheduler.grammar_bitmask(sched_out)

                fill = fill_bitmask

            self._inflight = (sched_out, self.runner.execute_async(sched_out, fill))
        elif sched_out.finished_req_ids:
            self.runner.update_states(sched_out)
        if prev is not None:
            outputs += self._collect(prev)
        if self._inflight is not None and not self.async_scheduling:
            outputs += self._collect(self._inflight)
            self._inflight = None
        outputs += self.scheduler.take_aborted()
        if sched_out.is_empty and self._inflight is None and not outputs:
            # Only requests whose grammar still compiles: block (bounded, so a serving loop
            # still reads new requests) rather than spin on empty steps.
            pending = self.scheduler.blocking_grammars()
            if pending:
                futures.wait(pending, timeout=_GRAMMAR_WAIT_S, return_when=futures.FIRST_COMPLETED)
        self.num_steps += 1
        return EngineCoreOutputs(outputs=outputs, stats=self.get_stats(), timestamp=time.time())

    def _may_overlap(self, inflight: SchedulerOutput) -> bool:
        # A verify step's kept guesses are unknown until it is collected: the next step's
        # positions depend on them.
        return (
            self.async_scheduling
            and not inflight.scheduled_spec_decode_tokens
            and self.scheduler.overlap_safe()
        )

    def _collect(self, inflight: tuple[SchedulerOutput, StepHandle]) -> list[EngineCoreOutput]:
        sched_out, handle = inflight
        sampled, logprobs = self.runner.collect(handle)
        if handle.prompt_logprobs:
            self.scheduler.add_prompt_logprobs(handle.prompt_logprobs)
        if handle.pooled:
            self.scheduler.add_pooled(handle.pooled)
        return self.scheduler.update(sched_out, sampled, logprobs, handle.num_tokens)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        self.runner.kv_caches.clear()
        if hasattr(self.runner, "shutdown"):  # tensor parallelism: stop the other ranks
            self.runner.shutdown()
        if self.structured is not None:
            self.structured.shutdown()


def _structured_manager(config: EngineConfig, eos: set[int]) -> StructuredOutputManager | None:
    """Grammars need the tokenizer's vocabulary; a model served without one has no structured
    output. The backend (tokenizer load, vocabulary scan) is built at the first constrained request."""
    mc = config.model_config
    if mc.tokenizer_path is None:
        return None

    def make_backend():  # noqa: ANN202 - imports xgrammar only when used
        from fulcrum.model.loader.tokenizer import load_tokenizer
        from fulcrum.structured.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(load_tokenizer(mc), mc.vocab_size, sorted(eos))

    return StructuredOutputManager(make_backend)
