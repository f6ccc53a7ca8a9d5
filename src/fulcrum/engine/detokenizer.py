"""Incremental detokenization with stop strings, for one sequence of one request.

Text comes from ``tokenizers``' ``DecodeStream`` over the output tokens: it emits a chunk only
once the decoded text no longer ends in a partial UTF-8 character, so streamed text never holds a
U+FFFD that a later token would have completed. With byte-fallback vocabularies (``<0xNN>``
pieces) a later byte token can still turn an earlier, valid byte group into U+FFFDs, so trailing
byte tokens wait until a regular token closes their group. When the sequence finishes, the text
is checked against (and completed from) one full decode, so the final text equals
``tokenizer.decode(output_ids, skip_special_tokens=...)``.

```
token ids ──► DecodeStream ──► _text ──► stop search ──► output_text ──► get_delta()
                                         (new text +     (cut before    (held back: a tail that
                                          lookback)       or after stop) may begin a stop string)
```
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from fulcrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_METASPACE = "\u2581"  # SentencePiece's word-boundary marker
_CONTEXT_TOKENS = 6  # tokens of context when a decode stream is restarted


def group_open_ids(backend: Tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """Tokens that leave a byte-fallback group open: ``<0xNN>`` pieces, and special tokens when
    they are skipped (the decoder never sees them). Empty for tokenizers without byte fallback.
    """
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    ids = {backend.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    if skip_special_tokens:
        ids |= {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    return frozenset(i for i in ids if i is not None)


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step, and finds stop strings.

    ``update`` appends tokens and reports a matched stop string; ``get_delta`` returns the text
    not yet handed out. While the sequence runs, a tail that could be the start of a stop string
    is held back, so a stop string never leaks even when it spans tokens.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise TypeError("IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer")
        self.tokenizer = tokenizer
        self.backend: Tokenizer = backend
        # The output text is decoded on its own, as ``tokenizer.decode(output_ids)`` would.
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the sequence
        self._stops: list[str] = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._group_open = group_open_ids(self.backend, self.skip_special_tokens)
        self._pending: list[int] = []  # trailing byte tokens not yet given to the stream
        self._text = ""  # decoded so far, stop string not yet cut
        self._covered = 0  # tokens fully reflected in ``_text``
        self._cut: int | None = None  # output_text length once a stop string matched
        self._finalized = False
        self._sent = 0  # characters of output_text returned by get_delta

    @property
    def output_text(self) -> str:
        """The text so far, with a matched stop string cut (or kept, if so configured)."""
        return self._text if self._cut is None else self._text[: self._cut]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Append tokens; return the stop string that matched, else ``None``.

        The text is cut before the stop string, or after it when
        ``params.include_stop_str_in_output``. When several stop strings complete in one
        update, the one that starts first wins. After a match, further tokens are ignored.
        ``finished`` flushes any bytes still waiting to complete a character.
        """
        if self.stopped or self._finalized:
            return None
        search_from = len(self._text)
        self.token_ids.extend(new_token_ids)
        feed = self._pending + new_token_ids
        split = len(feed)
        if not finished:
            while split > 0 and feed[split - 1] in self._group_open:
                split -= 1
        feed, self._pending = feed[:split], feed[split:]
        if feed:
            chunk = self._step(feed)
            if chunk:
                self._text += chunk
                self._covered = len(self.token_ids) - len(self._pending)
        if finished:
            search_from = min(search_from, self._finalize())
        if not self._stops:
            return None
        return self._check_stop(search_from)

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls.

        While not finished (and not stopped), a trailing part that could begin a stop string is
        held back; it is released once it cannot, or when the sequence finishes.
        """
        if finished and not self._finalized and not self.stopped:
            self.update([], finished=True)
        text = self.output_text
        end = len(text)
        if not (finished or self.stopped or self.params.include_stop_str_in_output):
            end -= self._partial_stop_len(text)
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def decode_token(self, token_id: int) -> str:
        """One token's text for logprob entries (special tokens shown, leading space kept)."""
        text = self.backend.decode([token_id], skip_special_tokens=False)
        piece = self.backend.id_to_token(token_id)
        if piece is not None and piece.startswith(_METASPACE) and not text.startswith(" "):
            # SentencePiece decoders drop the word marker of a sequence's first token.
            text = " " + text
        return text

    # -- internals ---------------------------------------------------------------------------

    def _step(self, ids: list[int]) -> str | None:
        try:
            return self._stream.step(self.backend, ids)
        except Exception as exc:  # tokenizers raises a bare Exception on an invalid prefix
            logger.debug("decode stream reset after %r", exc)
        # Restart from the last point the text was complete, with a little context before it.
        start = max(0, self._covered - _CONTEXT_TOKENS)
        context = self.token_ids[start : self._covered]
        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        try:
            end = len(self.token_ids) - len(self._pending)
            return self._stream.step(self.backend, self.token_ids[self._covered : end])
        except Exception as exc:
            # Leave the rest to the full decode when the sequence finishes.
            logger.warning("incremental detokenization failed (%r); text completes at the end", exc)
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._covered = len(self.token_ids) - len(self._pending)
            return None

    def _finalize(self) -> int:
        """Complete the text from a full decode; return where it first differs from before."""
        self._finalized = True
        full = self.backend.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.startswith(self._text):
            same = len(self._text)
        else:
            same = 0
            while same < min(len(full), len(self._text)) and full[same] == self._text[same]:
                same += 1
            logger.warning("incremental text diverged from the full decode at char %d", same)
        self._text = full
        self._covered = len(self.token_ids)
        self._pending = []
        return same

    def _check_stop(self, search_from: int) -> str | None:
        """Find the earliest stop string ending in the text after ``search_from``."""
        start = max(0, search_from - self._max_stop_len + 1)
        best: tuple[int, int, str] | None = None
        for order, stop in enumerate(self._stops):
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or (idx, order) < best[:2]):
                best = (idx, order, stop)
        if best is None:
            return None
        idx, _, stop = best
        self._cut = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.stop_reason = stop
        return stop

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
