"""A tiny engine core for testing the process boundary without a model.

Each step emits one token per running request (token id = 100 + position) and finishes a request
at its ``max_tokens``; each request holds one KV block until it finishes or is aborted.
"""

from __future__ import annotations

import os

from fulcrum.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)


class FakeCore:
    def __init__(self, num_blocks: int = 8, crash_on_step: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.max_model_len = 64
        self.vocab_size = 1000
        self.running: dict[str, tuple[EngineCoreRequest, int]] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.crash_on_step = crash_on_step

    def add_request(self, req: EngineCoreRequest) -> None:
        if not req.prompt_token_ids:
            raise ValueError("prompt: the prompt is empty.")
        if len(self.running) >= self.num_blocks:
            raise ValueError("prompt: no free KV block.")
        self.running[req.request_id] = (req, 0)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.aborted)

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        if self.crash_on_step is not None and self.steps >= self.crash_on_step:
            raise RuntimeError("simulated crash")
        outs = [EngineCoreOutput(rid, 0, [], finish_reason="abort") for rid in self.aborted]
        self.aborted = []
        for rid, (req, n) in list(self.running.items()):
            n += 1
            done = n >= req.sampling_params.max_tokens
            outs.append(
                EngineCoreOutput(rid, 0, [100 + n], finish_reason="length" if done else None)
            )
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (req, n)
        return EngineCoreOutputs(outputs=outs, stats=self.get_stats())

    def get_stats(self) -> SchedulerStats:
        used = len(self.running)
        return SchedulerStats(
            num_running=used,
            num_blocks_total=self.num_blocks,
            num_blocks_free=self.num_blocks - used,
            kv_cache_usage=used / self.num_blocks,
        )

    def shutdown(self) -> None:
        marker = os.environ.get("FAKE_CORE_SHUTDOWN_MARKER")
        if marker:
            with open(marker, "w") as f:
                f.write("shutdown")


def make_fake_core() -> FakeCore:
    return FakeCore()


def make_crashing_core() -> FakeCore:
    return FakeCore(crash_on_step=2)
