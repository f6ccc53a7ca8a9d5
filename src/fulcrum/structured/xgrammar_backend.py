"""The xgrammar backend: ``GrammarCompiler`` for the model's tokenizer, one ``GrammarMatcher`` per
sequence. The bitmask is xgrammar's layout (int32 words over the model's vocabulary, which may
be larger than the tokenizer's: the padding ids are never allowed)."""

from __future__ import annotations

from typing import Any

import numpy as np
import xgrammar as xgr

from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from fulcrum.structured.grammars import build_grammar

_BATCH_MIN_ROWS = 4  # below this, thread hand-off costs more than it spreads


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
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        # One thread per compile: the manager's pool runs compiles side by side.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        # A step's rows are filled by C++ threads, outside the GIL: the fill must finish while
        # the device runs the step's forward, and row by row its cost grows with the batch.
        # xgrammar's default takes half the cores; the rest keep the engine loop, the compiles
        # and the API process running.
        self._batch = xgr.BatchGrammarMatcher()

    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]
    ) -> None:
        if len(matchers) < _BATCH_MIN_ROWS:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)

    def accept_tokens(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        # A token's advance walks its bytes through the grammar's parser: long tokens of a large
        # vocabulary cost tens of microseconds each, so a batch's advances go to C++ threads.
        if len(matchers) < _BATCH_MIN_ROWS:
            return super().accept_tokens(matchers, tokens)
        handles = [m._m for m in matchers]  # type: ignore[attr-defined]
        return [bool(a) for a in self._batch.batch_accept_token(handles, tokens)]

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return XgrammarCompiled(self.compiler.compile_grammar(build_grammar(params)))

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        return np.full((rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
