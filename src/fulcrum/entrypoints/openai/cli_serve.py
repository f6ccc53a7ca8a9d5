"""`fulcrum serve`: the OpenAI-compatible HTTP server (engine core in its own process)."""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

from fulcrum import envs
from fulcrum.engine.arg_utils import EngineArgs
from fulcrum.entrypoints.openai.limits import MAX_LOGPROBS, MAX_N
from fulcrum.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from fulcrum.entrypoints.openai.tool_parsers import PARSERS
from fulcrum.ray import cli as ray_cli

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PORT_MAX = 65535
# A smaller body limit turns away even a short chat request: every POST would get 413.
MIN_REQUEST_BYTES = 1024


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {n}")
    return n


def _bounded_int(low: int, high: int | None) -> Any:
    def parse(value: str) -> int:
        n = int(value)
        if n < low or (high is not None and n > high):
            top = "" if high is None else f" and at most {high}"
            raise argparse.ArgumentTypeError(f"must be at least {low}{top}, got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def _seconds(value: str) -> float:
    t = float(value)
    if not (math.isfinite(t) and t >= 0):  # also NaN, which compares false with everything
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return t


_seconds.__name__ = "float"  # argparse names the type in "invalid float value"


def _model_name(value: str) -> str:
    # An empty id would be what /v1/models lists and what clients must send back.
    if not value.strip():
        raise argparse.ArgumentTypeError("a model name must not be empty")
    return value


def add_model_args(s: Any) -> None:
    """The options of what the API answers, shared by ``serve`` and ``run-batch``: model names,
    chat template, parsers and request limits."""
    s.add_argument(
        "--served-model-name",
        nargs="+",
        type=_model_name,
        default=None,
        help="Model name(s) clients use; the first is reported in responses "
        f"(default: the --model argument, or {DEFAULT_MODEL_NAME}).",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="Chat template (a file path, or the template text itself) replacing the model's; "
        "compiled at start-up, so a missing file or a syntax error stops the server there.",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="How the model writes tool calls (default: chosen from the chat template).",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="Split a reasoning model's thinking (<think>...</think>) into the message's "
        "reasoning_content: deepseek_r1 (the output may begin inside the thinking) or qwen3 "
        "(only an output that opens with <think>) (default: the thinking stays in content).",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Let requests supply their own chat_template (rendered in the sandbox).",
    )
    s.add_argument(
        "--max-n",
        type=_bounded_int(1, MAX_N),
        default=MAX_N,
        help=f"Largest accepted n, at most {MAX_N} (default: %(default)s).",
    )
    s.add_argument(
        "--max-logprobs",
        type=_bounded_int(0, MAX_LOGPROBS),
        default=MAX_LOGPROBS,
        help=f"Largest accepted top_logprobs / logprobs, at most {MAX_LOGPROBS} "
        "(default: %(default)s).",
    )
    s.add_argument(
        "--max-tokens-default",
        type=_bounded_int(1, None),
        default=None,
        help="Output tokens a chat completion may generate when the request sets no "
        "max_tokens / max_completion_tokens (default: up to the context length). "
        "Completions keep OpenAI's default of 16.",
    )
    s.add_argument(
        "--max-tokens-limit",
        type=_bounded_int(1, None),
        default=None,
        help="Largest max_tokens a request may ask for; larger values get 400, and it also "
        "caps the default (default: no limit beyond the context length).",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Server log level (default: %(default)s).",
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="Run the OpenAI-compatible API server.",
        description="Serve a model over the OpenAI API (chat, completions, responses, models, "
        "tokenize, metrics; with --runner pooling: embeddings, classify, score, rerank). The "
        "engine core runs in a child process.",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind (use 0.0.0.0 to listen on every interface; default: %(default)s).",
    )
    s.add_argument(
        "--port",
        type=_bounded_int(0, PORT_MAX),  # the OS would bind the value modulo 65536
        default=8000,
        help="TCP port to listen on, 0 to 65535 (default: %(default)s).",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /metrics, "
        "/openapi.json, /docs and /redoc; /health, /ready and /version stay open "
        "(default: $FULCRUM_API_KEY, else no key).",
    )
    s.add_argument(
        "--public-endpoints",
        action="store_true",
        help="With --api-key, leave /metrics, /openapi.json, /docs and /redoc open (for a "
        "Prometheus scraper without the key); the API routes still need it.",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="Origins a browser may call the API from (CORS), e.g. https://app.example.com, or "
        "'*' for any; preflight requests are answered before the API key is checked "
        "(default: none, no CORS headers).",
    )
    s.add_argument(
        "--ssl-keyfile",
        default=None,
        help="Serve HTTPS with this private key (PEM); needs --ssl-certfile (default: HTTP).",
    )
    s.add_argument(
        "--ssl-certfile",
        default=None,
        help="The certificate (PEM, chain included) for --ssl-keyfile.",
    )
    s.add_argument(
        "--max-request-bytes",
        type=_bounded_int(MIN_REQUEST_BYTES, None),
        default=8 * 1024 * 1024,
        help=f"Largest accepted request body in bytes, at least {MIN_REQUEST_BYTES}; larger "
        "bodies get 413 (default: %(default)s).",
    )
    s.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=1024,
        help="Sequences (prompts x n) allowed to wait beyond --max-num-seqs running ones; "
        "more get 429, and a request that could never fit gets 400 (default: %(default)s).",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="Seconds in-flight requests may run after SIGTERM before being aborted "
        "(default: %(default)s).",
    )
    s.add_argument(
        "--api-server-count",
        type=_bounded_int(1, 64),
        default=1,
        help="HTTP processes sharing one engine core (tokenization, detokenization and streaming "
        "spread over them; the kernel balances connections on the one port). Use 2-4 when one "
        "process cannot keep up with the engine's tokens/s (default: %(default)s).",
    )
    s.add_argument(
        "--log-requests-file",
        default=None,
        help="Append one JSON line per finished request to this file (traffic log).",
    )
    s.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Log every HTTP request line.",
    )
    add_model_args(s)
    ray_cli.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_serve)
    return p


def _load_template(value: str | None) -> str | None:
    """``--chat-template``'s text (read from the file it names, or the value itself), compiled
    here so that a bad one stops the server at start-up, not every chat request with a 400."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    elif "{" in value:  # Jinja text: every useful template has {{ ... }} or {% ... %}
        text = value
    elif os.path.isdir(value):
        raise ValueError(f"--chat-template: {value!r} is a directory, not a template file")
    else:  # a mistyped path, which would otherwise be rendered as the literal prompt
        raise ValueError(f"--chat-template: no such file {value!r}")
    _check_template(text)
    return text


def _check_template(text: str) -> None:
    # The environment requests are rendered in (chat_template.py), so what compiles here
    # compiles there.
    from jinja2 import TemplateError, TemplateSyntaxError
    from jinja2.exceptions import SecurityError

    from fulcrum.entrypoints.openai.template_sandbox import make_env

    try:
        make_env().from_string(text)
    except TemplateSyntaxError as e:  # its str() spans lines (location, source line)
        raise ValueError(
            f"--chat-template: does not compile (line {e.lineno}): {e.message}"
        ) from None
    except SecurityError as e:
        raise ValueError(f"--chat-template: rejected by the sandbox: {e}") from None
    except TemplateError as e:
        raise ValueError(f"--chat-template: does not compile: {e}") from None


def run_serve(args: argparse.Namespace) -> int:
    logging.getLogger("fulcrum").setLevel(args.log_level.upper())
    engine_args = EngineArgs.from_cli_args(args)
    options = serve_options(args, engine_args)
    _check_tls(args)
    if ray_cli.wanted(args):  # replicas on Ray Serve; each resolves the model on its own node
        if options.lora_adapters or engine_args.allow_runtime_lora_updates:
            raise SystemExit("--lora-modules: LoRA adapters are not supported with --ray yet.")
        return ray_cli.run_serve_ray(args, options, engine_args)
    # Resolve the model here so bad arguments fail with one line before the server starts.
    engine_config = engine_args.create_engine_config()
    if args.api_server_count > 1:
        from fulcrum.entrypoints.openai.multi_api import run_multi_api

        return run_multi_api(args, options, engine_config)
    from fulcrum.entrypoints.openai.api_process import serve_api

    return serve_api(args, options, engine_config)


def _check_tls(args: argparse.Namespace) -> None:
    """Both TLS files or neither, readable, and not with Ray Serve (its proxy serves HTTP)."""
    given = [f for f in ("ssl_keyfile", "ssl_certfile") if getattr(args, f)]
    if not given:
        return
    if len(given) == 1:
        raise SystemExit(f"--{given[0].replace('_', '-')} needs the other TLS file as well.")
    if ray_cli.wanted(args):
        raise SystemExit("--ssl-keyfile/--ssl-certfile: not supported with --ray.")
    for f in given:
        path = getattr(args, f)
        if not os.path.isfile(path):
            raise SystemExit(f"--{f.replace('_', '-')}: no such file {path!r}.")


def serve_options(args: argparse.Namespace, engine_args: EngineArgs) -> Any:
    from fulcrum.engine.arg_utils import parse_lora_modules
    from fulcrum.entrypoints.openai.serving_base import ServeOptions

    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    try:
        adapters = dict(parse_lora_modules(engine_args.lora_modules).adapters)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    clash = set(adapters) & set(names)
    if clash:
        raise SystemExit(f"--lora-modules: adapter name {sorted(clash)[0]!r} is also a served "
                         "model name (--served-model-name).")  # fmt: skip
    return ServeOptions(
        served_model_names=names,
        model_root=args.model or DEFAULT_MODEL_NAME,
        api_key=args.api_key or envs.FULCRUM_API_KEY.get() or None,
        public_endpoints=args.public_endpoints,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template=_load_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        max_num_seqs=engine_args.max_num_seqs,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_tokens_default=args.max_tokens_default,
        max_tokens_limit=args.max_tokens_limit,
        shutdown_timeout=args.shutdown_timeout,
        log_requests_file=args.log_requests_file,
        allowed_origins=list(args.allowed_origins or []),
        lora_adapters=adapters,
    )
