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
import torch

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from fulcrum.structured.thinking import GatedMatcher, allow_token

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
        self._buffers: list[torch.Tensor] = []  # host bitmasks, used in turn (see ``bitmask``)
        self._turn = 0

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
        """One row per sampled row; rows without a grammar allow everything.

        The rows live in one of two page-locked host buffers, used in turn, so the copy to the
        device neither pins a fresh megabyte each step nor waits on the stream. Two suffice:
        a step's mask is filled after the step before it was collected, i.e. after that
        step's sampling (and the copy of its mask) finished on the device."""
        n = len(matchers)
        if not self._buffers or self._buffers[0].shape[0] < n:
            words = self.backend.allocate_bitmask(1).shape[1]
            cap = 1 << max(n - 1, 0).bit_length()
            pin = torch.cuda.is_available()
            self._buffers = [
                torch.empty((cap, words), dtype=torch.int32, pin_memory=pin) for _ in range(2)
            ]
        self._turn ^= 1
        mask = self._buffers[self._turn].numpy()[:n]
        # A gated row (a reasoning model's) is free while it thinks; its grammar's otherwise.
        grammars = [m.active() if isinstance(m, GatedMatcher) else m for m in matchers]
        rows = [row for row, m in enumerate(grammars) if m is not None]
        if len(rows) < n:
            mask[[row for row, m in enumerate(grammars) if m is None]] = -1
        if rows:
            self.backend.fill_bitmasks([grammars[r] for r in rows], mask, rows)  # type: ignore[misc]
        for row, m in enumerate(matchers):
            if isinstance(m, GatedMatcher):
                allow_token(mask, row, m.opening_token())
        return mask

    def accept(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token (one step's single-token rows, together); a
        gated matcher's gate takes its thinking's tokens first."""
        ok = [True] * len(matchers)
        rows = [
            i for i, (m, t) in enumerate(zip(matchers, tokens, strict=True))
            if not (isinstance(m, GatedMatcher) and m.take(t))
        ]  # fmt: skip
        grammars = [m.inner if isinstance(m, GatedMatcher) else m for m in matchers]
        got = self.backend.accept_tokens([grammars[i] for i in rows], [tokens[i] for i in rows])
        for i, g in zip(rows, got, strict=True):
            ok[i] = g
            if not g and isinstance(matchers[i], GatedMatcher):
                matchers[i].untake()  # type: ignore[union-attr]
        return ok

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:
            self._backend.close()
