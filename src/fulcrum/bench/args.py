"""Argument parsing helpers and the dataset flags shared by ``bench serve`` and ``bench offline``."""

from __future__ import annotations

import argparse
import math
from typing import Any

DATASETS = ("random", "prefix-repetition", "multi-turn", "sharegpt-like", "trace")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def concurrency_list(text: str) -> list[int | None]:
    """``"1,10,50"`` -> [1, 10, 50]; ``"none"``/``"inf"`` -> uncapped (None)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "inf", ""):
            out.append(None)
        else:
            out.append(positive_int(part))
    return out


def rate_list(text: str) -> list[float | None]:
    """``"1,4,inf"`` -> [1.0, 4.0, None] (None: every request sent at once)."""
    out: list[float | None] = []
    for part in text.split(","):
        v = positive_float(part.strip())
        out.append(None if math.isinf(v) else v)
    return out


def add_dataset_args(p: argparse.ArgumentParser, *, with_trace: bool = True) -> None:
    names = (
        DATASETS if with_trace else tuple(d for d in DATASETS if d not in ("trace", "multi-turn"))
    )
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name", choices=names, default="random", help="Workload (default random)."
    )
    g.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="Requests per run (default 100; trace: every record).",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="Seed of prompts, lengths and arrivals (default 0)."
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer (HF dir or .gguf) of the served model; default: the embedded model's.",
    )
    g.add_argument(
        "--prompt-format",
        choices=("auto", "token-ids", "text"),
        default="auto",
        help="Random prompts as token ids or decoded text (auto: token ids for completions, text for chat).",
    )
    g.add_argument(
        "--random-input-len",
        type=positive_int,
        default=256,
        help="random: mean prompt tokens (default 256).",
    )
    g.add_argument(
        "--random-output-len",
        type=positive_int,
        default=128,
        help="random: mean output tokens (default 128).",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [L(1-r), L(1+r)] (default 0).",
    )
    g.add_argument(
        "--prefix-num-prefixes",
        type=positive_int,
        default=4,
        help="prefix-repetition: distinct shared prefixes (default 4).",
    )
    g.add_argument(
        "--prefix-len",
        type=positive_int,
        default=256,
        help="prefix-repetition: tokens per shared prefix (default 256).",
    )
    g.add_argument(
        "--prefix-suffix-len",
        type=positive_int,
        default=64,
        help="prefix-repetition: unique suffix tokens (default 64).",
    )
    g.add_argument(
        "--prefix-output-len",
        type=positive_int,
        default=64,
        help="prefix-repetition: output tokens (default 64).",
    )
    g.add_argument(
        "--sharegpt-output-len",
        type=positive_int,
        default=None,
        help="sharegpt-like: fix every output length (default: sampled).",
    )
    g.add_argument(
        "--sharegpt-max-input-len",
        type=positive_int,
        default=1024,
        help="sharegpt-like: clip prompts to this many tokens (default 1024).",
    )
    if with_trace:
        g.add_argument(
            "--multi-turn-conversations",
            type=positive_int,
            default=8,
            help="multi-turn: conversations (default 8).",
        )
        g.add_argument(
            "--multi-turn-turns",
            type=positive_int,
            default=4,
            help="multi-turn: turns per conversation (default 4).",
        )
        g.add_argument(
            "--multi-turn-input-len",
            type=positive_int,
            default=64,
            help="multi-turn: tokens per user turn (default 64).",
        )
        g.add_argument(
            "--multi-turn-output-len",
            type=positive_int,
            default=64,
            help="multi-turn: output tokens per turn (default 64).",
        )
        g.add_argument(
            "--multi-turn-system-len",
            type=non_negative_int,
            default=0,
            help="multi-turn: system prompt tokens, 0 for none (default 0).",
        )
        g.add_argument(
            "--trace-path",
            default=None,
            help="trace: JSONL request log to replay (server log or OpenAI bodies).",
        )
        g.add_argument(
            "--trace-speedup",
            type=positive_float,
            default=1.0,
            help="trace: replay this many times faster (default 1).",
        )
        g.add_argument(
            "--trace-output-len",
            type=positive_int,
            default=128,
            help="trace: output tokens when a record has none (default 128).",
        )


def dataset_params(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that define the chosen workload, for the results file."""
    prefix = {
        "random": "random_",
        "prefix-repetition": "prefix_",
        "multi-turn": "multi_turn_",
        "sharegpt-like": "sharegpt_",
        "trace": "trace_",
    }[args.dataset_name]
    params = {k: v for k, v in vars(args).items() if k.startswith(prefix)}
    if args.dataset_name != "multi-turn":
        params["num_prompts"] = num_prompts(args)
    return {"name": args.dataset_name, **params}


def num_prompts(args: argparse.Namespace) -> int | None:
    if args.num_prompts is not None:
        return args.num_prompts
    return None if args.dataset_name == "trace" else 100


def build_sessions(args: argparse.Namespace, tokenizer: Any, as_text: bool) -> list:
    """The workload's sessions, from the dataset flags (tokenizer unused for traces)."""
    from fulcrum.bench import datasets as ds

    name = args.dataset_name
    if name == "trace":
        if not args.trace_path:
            raise ValueError("--dataset-name trace needs --trace-path.")
        return ds.trace_dataset(
            args.trace_path, num_prompts(args), args.trace_output_len, args.trace_speedup
        )
    src = ds.TokenSource(tokenizer, args.seed)
    if name == "random":
        return ds.random_dataset(
            src,
            num_prompts(args),
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            as_text,
        )
    if name == "prefix-repetition":
        return ds.prefix_repetition_dataset(
            src,
            num_prompts(args),
            args.prefix_num_prefixes,
            args.prefix_len,
            args.prefix_suffix_len,
            args.prefix_output_len,
            as_text,
        )
    if name == "multi-turn":
        return ds.multi_turn_dataset(
            src,
            args.multi_turn_conversations,
            args.multi_turn_turns,
            args.multi_turn_input_len,
            args.multi_turn_output_len,
            args.multi_turn_system_len,
        )
    return ds.sharegpt_like_dataset(
        src, num_prompts(args), args.sharegpt_output_len, args.sharegpt_max_input_len, as_text
    )
