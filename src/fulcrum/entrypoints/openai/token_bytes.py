"""A token's raw bytes, as OpenAI's logprobs report them (``bytes``, and the character offsets
derived from them).

A token that carries part of a multi-byte character (emoji, CJK in byte-level BPE, or
SentencePiece's ``<0xE2>`` byte-fallback pieces) decodes alone to U+FFFD; its own bytes are what
let a client rebuild the text from the tokens. The vocabulary string holds them: byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM) maps each byte to one printable character, and SentencePiece
writes a byte piece as ``<0xHH>`` and a space as ``▁``. Tokenizers of neither kind fall back to
the decoded text's UTF-8.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_KINDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _kind(tokenizer: Any) -> str:
    """``byte_level``, ``sentencepiece`` or ``text``, from the fast tokenizer's decoder."""
    try:
        return _KINDS[tokenizer]
    except (KeyError, TypeError):
        pass
    kind = "text"
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is not None:
        state = json.loads(decoder.__getstate__())
        names = {d.get("type") for d in state.get("decoders", [state])}
        if "ByteLevel" in names:
            kind = "byte_level"
        elif "ByteFallback" in names or "Metaspace" in names:
            kind = "sentencepiece"
    try:
        _KINDS[tokenizer] = kind
    except TypeError:
        pass
    return kind


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The raw bytes of ``token_id`` (``text``: its decoded text, the fallback)."""
    kind = _kind(tokenizer)
    if kind == "text":
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return text.encode()
    if kind == "byte_level":
        table = _byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()  # an added token written as itself
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("▁", " ").encode()
