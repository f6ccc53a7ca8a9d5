"""The xgrammar backend: ``GrammarCompiler`` for the model's tokenizer, one ``GrammarMatcher`` per
sequence. The bitmask is xgrammar's layout (int32 words over the model's vocabulary, which may
be larger than the tokenizer's: the padding ids are never allowed)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xgrammar as xgr

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from fulcrum.structured.grammars import build_grammar

# Rows per thread below which a hand-off to another thread costs more than the rows: a row's
# fill or advance costs ~10-60 us, waking a worker and collecting its result ~20-50 us.
_ROWS_PER_THREAD = 4


def default_threads() -> int:
    """Threads that fill and advance a step's matchers: half the cores, at most 8 (xgrammar's
    own default); the rest keep the engine loop, the compiles and the API process running."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)  # rollback depth is unlimited in xgrammar

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def rollback(self, k: int) -> None:
        if k:
            self._m.rollback(k)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XgrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> GrammarMatcher:
        return XgrammarMatcher(self.compiled)


class XgrammarBackend(GrammarBackend):
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int | None = None
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        # One thread per compile: the manager's pool runs compiles side by side.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        # A step's rows are filled and advanced on threads, each thread's slice in one call of
        # xgrammar's batch API. Its calls release the GIL, so the slices run side by side; a
        # call per row would retake the GIL per row, and each retake waits out the
        # interpreter's switch interval whenever another thread runs Python (two threads
        # advancing row by row were slower than one). xgrammar's own ``BatchGrammarMatcher``
        # advances a batch on one thread and its fill starts a thread pool per call: hence
        # one single-threaded batch matcher per slice, on our own pool.
        self.threads = threads if threads is not None else default_threads()
        self._batch = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self.threads)]
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-rows") \
            if self.threads > 1 else None

    def _spread(self, n: int, work: Callable[[int, list[int]], None]) -> None:
        """``work(slice_index, rows)`` over rows ``0..n-1`` split into strided slices (so costly
        rows, which come in runs of one request kind, spread out), the first on this thread."""
        k = min(self.threads, n // _ROWS_PER_THREAD)
        if k <= 1 or self._pool is None:
            work(0, list(range(n)))
            return
        futs = [self._pool.submit(work, i, list(range(i, n, k))) for i in range(1, k)]
        work(0, list(range(0, n, k)))
        for f in futs:
            f.result()

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]

        def fill(part: int, idx: list[int]) -> None:
            self._batch[part].batch_fill_next_token_bitmask(
                [handles[i] for i in idx], bitmask, [rows[i] for i in idx]
            )

        self._spread(len(handles), fill)

    def accept_tokens(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        # A token's advance walks its bytes through the grammar's parser: long tokens of a large
        # vocabulary cost tens of microseconds each.
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        ok = [False] * len(handles)

        def accept(part: int, idx: list[int]) -> None:
            got = xgr.BatchGrammarMatcher.batch_accept_token(
                [handles[i] for i in idx], [tokens[i] for i in idx]
            )
            for i, g in zip(idx, got, strict=True):
                ok[i] = g

        self._spread(len(handles), accept)
        return ok

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return XgrammarCompiled(self.compiler.compile_grammar(build_grammar(params)))

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        return np.full((rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
