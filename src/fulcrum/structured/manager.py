"""Grammars compiled off the engine loop, cached by key, and each step's bitmask.

``submit`` starts a compile on the thread pool (or joins one already cached/running for the same
constraint) and returns at once; the scheduler keeps the request waiting until ``ready`` says its
grammar is there, so a new schema never stalls other requests' steps. xgrammar's compile
releases the GIL, so the loop keeps stepping while it runs."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


def cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    return params.kind, params.spec


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], max_workers: int = 2) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()

    @property
    def backend(self) -> GrammarBackend:
        # Built on first use: loading the tokenizer's vocabulary is wasted on servers that
        # never see a constrained request.
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = cache_key(params)
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        backend = self.backend
        fut = self._pool.submit(backend.compile, params)
        self._cache[key] = fut
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return fut

    def bitmask(self, matchers: Sequence[GrammarMatcher | None]) -> np.ndarray:
        """One row per sampled row; rows without a grammar allow everything."""
        mask = self.backend.allocate_bitmask(len(matchers))
        rows = [row for row, m in enumerate(matchers) if m is not None]
        if rows:
            self.backend.fill_bitmasks([matchers[r] for r in rows], mask, rows)  # type: ignore[misc]
        return mask

    def accept(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token (one step's single-token rows, together)."""
        return self.backend.accept_tokens(matchers, tokens)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
