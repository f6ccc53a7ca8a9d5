"""`fulcrum run-batch`: a file of OpenAI batch requests through the engine, offline.

The input is OpenAI's Batch API format, one JSON request per line::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and the output one line per request, in the input's order::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

Each request goes through the server's own app in this process (no socket): the same
validation, defaults and response bodies as ``fulcrum serve``, a 400 body for a bad request.
Every request is in flight at once, up to ``--max-concurrency``, so the engine batches them.
A line that is not a request (not JSON, no ``custom_id``, another method or URL) gets
``response: null`` and an ``error`` naming what is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from typing import Any

from fulcrum.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank",
        "/classify")  # fmt: skip


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


_positive.__name__ = "int"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fulcrum.entrypoints.openai.cli_serve import add_model_args

    p = subparsers.add_parser(
        "run-batch",
        help="Run a file of OpenAI batch requests (JSONL) offline.",
        description="Read OpenAI Batch API requests (one JSON object per line: custom_id, "
        f"method POST, url one of {', '.join(URLS)}, body), run them all through the engine "
        "and write one result per line in the same order, as the Batch API's output file.",
    )
    b = p.add_argument_group("batch")
    b.add_argument("-i", "--input-file", required=True,
                   help="The requests, JSONL; '-' reads standard input.")  # fmt: skip
    b.add_argument("-o", "--output-file", required=True,
                   help="Where the results go, JSONL; '-' writes standard output.")  # fmt: skip
    b.add_argument("--max-concurrency", type=_positive, default=1024,
                   help="Requests in flight at once (default: %(default)s).")  # fmt: skip
    add_model_args(b)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_batch_cli)
    return p


def parse_line(line: str, seen: set[str]) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """``(request, custom_id, error)`` of one input line: the request (None if the line is not
    one) and, where it is not, what is wrong."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return None, None, f"the line is not JSON: {e}"
    if not isinstance(req, dict):
        return None, None, "the line must be a JSON object"
    cid = req.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, None, "custom_id: a non-empty string is required"
    if cid in seen:
        return None, cid, f"custom_id: {cid!r} appears twice; each request needs its own"
    seen.add(cid)
    if req.get("method", "POST") != "POST":
        return None, cid, f"method: only POST is supported, got {req.get('method')!r}"
    if req.get("url") not in URLS:
        return None, cid, f"url: expected one of {', '.join(URLS)}, got {req.get('url')!r}"
    body = req.get("body")
    if not isinstance(body, dict):
        return None, cid, "body: a JSON object is required"
    if body.get("stream"):
        return None, cid, "body.stream: a batch request cannot stream"
    return req, cid, None


def _record(cid: str | None, status: int | None, body: Any, error: str | None) -> dict[str, Any]:
    response = None
    if status is not None:
        rid = body.get("id") if isinstance(body, dict) else None
        response = {"status_code": status, "request_id": rid or f"req_{uuid.uuid4().hex}",
                    "body": body}  # fmt: skip
    err = None if error is None else {"code": "invalid_request", "message": error}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": cid, "response": response,
            "error": err}  # fmt: skip


async def run_batch(
    lines: list[str], app: Any, max_concurrency: int, progress: bool = True
) -> list[dict[str, Any]]:
    """The output records of ``lines`` (blank lines skipped), each request sent to ``app`` (the
    server's ASGI app, its lifespan running)."""
    import httpx

    items = [(n, ln) for n, ln in enumerate(lines, start=1) if ln.strip()]
    out: list[dict[str, Any] | None] = [None] * len(items)
    seen: set[str] = set()
    parsed = []
    for n, ln in items:
        req, cid, error = parse_line(ln, seen)
        parsed.append((req, cid, None if error is None else f"line {n}: {error}"))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(items), desc="Batch", unit="req", dynamic_ncols=True, file=sys.stderr)
    sem = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as c:

        async def one(i: int) -> None:
            req, cid, error = parsed[i]
            if req is None:
                out[i] = _record(cid, None, None, error)
            else:
                async with sem:
                    r = await c.post(req["url"], json=req["body"])
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
                out[i] = _record(cid, r.status_code, body, None)
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(items))))
    if bar is not None:
        bar.close()
    return [r for r in out if r is not None]


def run_batch_cli(args: argparse.Namespace) -> int:
    from fulcrum.engine.async_engine import AsyncEngine
    from fulcrum.entrypoints.openai.api_server import build_app
    from fulcrum.entrypoints.openai.cli_serve import serve_options
    from fulcrum.entrypoints.openai.serving_base import ServerState

    logging.getLogger("fulcrum").setLevel(args.log_level.upper())
    try:
        src = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--input-file: cannot read {args.input_file!r}: {e}") from None
    with src:
        lines = src.read().splitlines()
    # what only a socket server has: no key, no body limit beyond the default, no CORS
    for name, value in (("api_key", None), ("public_endpoints", False), ("allowed_origins", None),
                        ("max_request_bytes", 1 << 30), ("shutdown_timeout", 0.0),
                        ("log_requests_file", None)):  # fmt: skip
        setattr(args, name, value)
    args.max_queued_requests = args.max_concurrency * 16  # each may ask for n sequences
    engine_args = EngineArgs.from_cli_args(args)
    options = serve_options(args, engine_args)
    engine_config = engine_args.create_engine_config()
    state = ServerState(options)

    async def make_engine(metrics: Any) -> AsyncEngine:
        return await AsyncEngine.from_engine_config(engine_config, stats_sink=metrics)

    app = build_app(state, make_engine)

    async def main() -> list[dict[str, Any]]:
        async with app.router.lifespan_context(app):
            return await run_batch(lines, app, args.max_concurrency)

    records = asyncio.run(main())
    text = "".join(json.dumps(r) + "\n" for r in records)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    ok = sum(1 for r in records if r["response"] and r["response"]["status_code"] == 200)
    print(f"fulcrum run-batch: {len(records)} requests, {ok} answered 200, "
          f"{len(records) - ok} not; results in {args.output_file}", file=sys.stderr)  # fmt: skip
    return 0
