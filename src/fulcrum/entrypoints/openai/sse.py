"""Server-sent events framing and the logprobs formats of both OpenAI APIs."""

from __future__ import annotations

import codecs
import math
from typing import Any

import msgspec

from fulcrum.engine.outputs import SampleLogprobs, TokenLogprob
from fulcrum.entrypoints.openai.errors import OpenAIError
from fulcrum.entrypoints.openai.token_bytes import token_bytes

_ENC = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # JSON has no -inf


def encode_json(obj: Any) -> bytes:
    return _ENC.encode(obj)


def sse_event(obj: Any) -> bytes:
    """One ``data: {json}\\n\\n`` event."""
    return b"data: " + _ENC.encode(obj) + b"\n\n"


def sse_error(err: OpenAIError) -> bytes:
    """An error after streaming began: an error event (the caller then sends ``[DONE]``)."""
    body = err.body()
    body["error"]["status"] = err.status
    return sse_event(body)


def _lp(x: float) -> float:
    return MIN_LOGPROB if math.isnan(x) or x < MIN_LOGPROB else float(x)


def _token_text(
    entry: TokenLogprob | None, token_id: int, tokenizer: Any, as_ids: bool = False
) -> str:
    """The token as logprobs name it: its text, or ``token_id:<id>`` (``as_ids``)."""
    if as_ids:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded:
        return entry.decoded
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _top(entries: dict[int, TokenLogprob], k: int) -> list[tuple[int, TokenLogprob]]:
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))
    return ranked[:k]


def _bytes(tokenizer: Any, token_id: int, text: str, as_ids: bool) -> list[int]:
    return list(text.encode() if as_ids else token_bytes(tokenizer, token_id, text))


def chat_logprobs(
    token_ids: list[int],
    logprobs: SampleLogprobs | None,
    top_n: int,
    tokenizer: Any,
    as_ids: bool = False,
) -> list[dict[str, Any]]:
    """``choice.logprobs.content`` entries: token, logprob, bytes, top_logprobs (exactly
    top_n); ``as_ids``: tokens named ``token_id:<id>``."""
    content: list[dict[str, Any]] = []
    for i, tid in enumerate(token_ids):
        entries = logprobs[i] if logprobs is not None and i < len(logprobs) else {}
        sampled = entries.get(tid)
        text = _token_text(sampled, tid, tokenizer, as_ids)
        tops = []
        for alt_id, alt in _top(entries, top_n):
            alt_text = _token_text(alt, alt_id, tokenizer, as_ids)
            alt_bytes = _bytes(tokenizer, alt_id, alt_text, as_ids)
            tops.append({"token": alt_text, "logprob": _lp(alt.logprob), "bytes": alt_bytes})
        content.append(
            {
                "token": text,
                "logprob": _lp(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                "bytes": _bytes(tokenizer, tid, text, as_ids),
                "top_logprobs": tops,
            }
        )
    return content


def prompt_logprobs_json(
    entries: list[dict[int, TokenLogprob] | None] | None, k: int, tokenizer: Any
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the token's own
    logprob, rank and text, and the ``k`` most likely tokens', keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries or []:
        if e is None:
            out.append(None)
            continue
        own = next(iter(e))  # the prompt token's own entry comes first
        keep = {tid: lp for tid, lp in e.items() if tid == own or lp.rank <= k}
        out.append(
            {
                str(tid): {
                    "logprob": _lp(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": _token_text(lp, tid, tokenizer),
                }
                for tid, lp in keep.items()
            }
        )
    return out


def completion_logprobs(
    token_ids: list[int],
    logprobs: SampleLogprobs | None,
    top_n: int,
    tokenizer: Any,
    text_offset: int,
    prompt_token_ids: list[int] | None = None,
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """Legacy format: tokens, token_logprobs, top_logprobs (top_n plus the sampled token),
    text_offset. Echoed prompt tokens come first: null logprobs for the first, and for every
    one where ``prompt_logprobs`` (one entry per prompt token) is not given. A token's offset counts
    the characters its predecessors' bytes complete: the pieces of one multi-byte character
    each decode to U+FFFD alone, but are one character of the text. ``as_ids``: tokens named
    ``token_id:<id>`` (the offsets still count the text)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, tid in enumerate(prompt_token_ids or []):
        text = str(tokenizer.decode([tid], skip_special_tokens=False))
        entries = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        tokens.append(_token_text(None, tid, tokenizer, True) if as_ids else text)
        if entries is None or tid not in entries:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_lp(entries[tid].logprob))
            top_logprobs.append(_legacy_top(entries, top_n, tid, tokenizer, as_ids))
        offsets.append(offset)
        offset += len(utf8.decode(token_bytes(tokenizer, tid, text)))
    for i, tid in enumerate(token_ids):
        entries = logprobs[i] if logprobs is not None and i < len(logprobs) else {}
        sampled = entries.get(tid)
        text = _token_text(sampled, tid, tokenizer)
        tokens.append(_token_text(sampled, tid, tokenizer, as_ids))
        token_logprobs.append(_lp(sampled.logprob) if sampled is not None else MIN_LOGPROB)
        top_logprobs.append(_legacy_top(entries, top_n, tid, tokenizer, as_ids))
        offsets.append(offset)
        offset += len(utf8.decode(token_bytes(tokenizer, tid, text)))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _legacy_top(
    entries: dict[int, TokenLogprob], top_n: int, tid: int, tokenizer: Any, as_ids: bool
) -> dict[str, float]:
    """The legacy format's top logprobs: the ``top_n`` most likely tokens by text (or
    ``token_id:<id>``), plus the token itself."""
    tops: dict[str, float] = {}
    for alt_id, alt in _top(entries, top_n):
        tops[_token_text(alt, alt_id, tokenizer, as_ids)] = _lp(alt.logprob)
    if tid in entries:
        tops.setdefault(_token_text(entries[tid], tid, tokenizer, as_ids), _lp(entries[tid].logprob))
    return tops

