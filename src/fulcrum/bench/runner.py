"""The asyncio load generator: sessions at their arrival times under a concurrency cap.

Arrivals: every session at once (``request_rate=None``), or gaps drawn from a gamma
distribution of shape ``burstiness`` and mean ``1/request_rate`` (shape 1 is Poisson; below 1
is burstier), or a trace's own times. A conversation's later turns are sent as soon as the
previous answer is complete. ``max_concurrency`` caps requests in flight (not sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from fulcrum.bench.client import Endpoint, RequestResult, send_request
from fulcrum.bench.datasets import Session


@dataclass
class LoadConfig:
    endpoint: Endpoint
    kind: str  # "chat" | "completions": the default endpoint for sessions
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


def _text(x: str | list[int], tokenizer: Any | None) -> str:
    if isinstance(x, str):
        return x
    if tokenizer is None:
        raise ValueError("token-id prompts on the chat endpoint need a tokenizer.")
    return tokenizer.decode(x)


def build_payload(
    cfg: LoadConfig,
    session: Session,
    turn_idx: int,
    answers: list[str],
    tokenizer: Any | None,
) -> tuple[str, dict[str, Any]]:
    """(endpoint kind, JSON body without model/stream) for turn ``turn_idx`` of ``session``."""
    kind = session.endpoint or cfg.kind
    turn = session.turns[turn_idx]
    if kind == "embeddings":  # the turn's prompt (after any shared prefix), nothing generated
        prompt = turn.prompt
        if isinstance(session.system, list) and isinstance(prompt, list):
            prompt = session.system + prompt
        elif session.system is not None:
            prompt = _text(session.system, tokenizer) + _text(prompt, tokenizer)
        return kind, {"input": prompt, **cfg.extra_body}
    body: dict[str, Any] = {"max_tokens": turn.output_len, "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if kind == "chat":
        if session.messages is not None:
            messages = list(session.messages)
        else:
            messages = []
            if session.system is not None:
                messages.append({"role": "system", "content": _text(session.system, tokenizer)})
            for k in range(turn_idx):
                messages.append(
                    {"role": "user", "content": _text(session.turns[k].prompt, tokenizer)}
                )
                messages.append({"role": "assistant", "content": answers[k]})
            messages.append({"role": "user", "content": _text(turn.prompt, tokenizer)})
        body["messages"] = messages
    elif turn_idx == 0 and session.system is None:
        body["prompt"] = turn.prompt
    elif turn_idx == 0 and isinstance(session.system, list) and isinstance(turn.prompt, list):
        body["prompt"] = session.system + turn.prompt
    else:
        parts = [_text(session.system, tokenizer)] if session.system is not None else []
        for k in range(turn_idx):
            parts += [_text(session.turns[k].prompt, tokenizer), answers[k]]
        parts.append(_text(turn.prompt, tokenizer))
        body["prompt"] = "\n".join(parts)
    body.update(cfg.extra_body)
    return kind, body


def arrival_offsets(
    sessions: list[Session], request_rate: float | None, burstiness: float, seed: int
) -> list[float]:
    """Seconds after the start at which each session begins."""
    if sessions and all(s.arrival_s is not None for s in sessions):
        return [float(s.arrival_s or 0.0) for s in sessions]
    if request_rate is None:
        return [0.0] * len(sessions)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive.")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=len(sessions))
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def _prompt_len_estimate(session: Session, turn_idx: int, answers: list[str], tok: Any) -> int:
    turn = session.turns[turn_idx]
    n = turn.prompt_len
    if session.messages is None and isinstance(session.system, list):
        n += len(session.system)
    elif session.messages is None and session.system is not None:
        n += len(tok.encode(session.system, add_special_tokens=False)) if tok else 0
    for k in range(turn_idx):
        n += session.turns[k].prompt_len
        n += len(tok.encode(answers[k], add_special_tokens=False)) if tok else 0
    return n


async def run_sessions(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    sessions: list[Session],
    *,
    max_concurrency: int | None,
    request_rate: float | None,
    burstiness: float = 1.0,
    tokenizer: Any | None = None,
    desc: str = "",
    show_progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Run every turn of every session; return the results and the run's duration (s)."""
    offsets = arrival_offsets(sessions, request_rate, burstiness, cfg.seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    total = sum(len(s.turns) for s in sessions)
    pbar = tqdm(total=total, desc=desc, disable=not show_progress, unit="req", leave=False)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def one_session(session: Session, offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        answers: list[str] = []
        for k in range(len(session.turns)):
            kind, body = build_payload(cfg, session, k, answers, tokenizer)
            est = _prompt_len_estimate(session, k, answers, tokenizer)
            guard = sem if sem is not None else contextlib.nullcontext()
            async with guard:
                res = await send_request(client, cfg.endpoint, kind, body, est, tokenizer)
            res.session_id, res.turn = session.session_id, k
            results.append(res)
            pbar.update(1)
            if not res.success:
                for j in range(k + 1, len(session.turns)):  # later turns cannot be built
                    results.append(
                        RequestResult(
                            error=f"skipped: turn {k} of its conversation failed",
                            session_id=session.session_id,
                            turn=j,
                        )
                    )
                    pbar.update(1)
                return
            answers.append(res.generated_text)

    try:
        await asyncio.gather(*(one_session(s, o) for s, o in zip(sessions, offsets, strict=True)))
    finally:
        pbar.close()
    return results, time.perf_counter() - start
