"""Where a slow token's time went: an optional per-step timeline of each server process.

Set ``FULCRUM_STEP_TRACE=/path/prefix`` and the engine core writes ``prefix.core.jsonl`` (one line
per busy-loop iteration: input drain, step, output push, the step's batch) and the API process
``prefix.api.jsonl`` (one line per outputs message: its delay after the core sent it and the time
spent turning it into client chunks). Both log garbage-collector pauses. Times are ``time.time()``
seconds, so the two files and a client's own timestamps line up on one clock. Off by default;
when off nothing here runs.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any, TextIO

from fulcrum import envs


class StepTrace:
    """Append-only JSONL writer; ``record`` is a dict per line, buffered, flushed at close."""

    def __init__(self, path: str) -> None:
        self._fh: TextIO = open(path, "w", buffering=1 << 20)  # noqa: SIM115 - closed in close()
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, role: str) -> StepTrace | None:
        prefix = envs.FULCRUM_STEP_TRACE.get()
        if not prefix:
            return None
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        return cls(f"{prefix}.{role}.jsonl")

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.time()
        else:
            self.record(
                {
                    "gc": info.get("generation"),
                    "t": self._gc_start,
                    "dur": time.time() - self._gc_start,
                }
            )

    def record(self, line: dict[str, Any]) -> None:
        self._fh.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if not self._fh.closed:
            self._fh.close()
