"""`fulcrum` command line: each subcommand lives in its own module exposing ``add_parser``."""

from __future__ import annotations

import argparse
import importlib
import sys

from fulcrum import __version__

# (subcommand module, exposes add_parser(subparsers) that sets `func` on its parser)
_SUBCOMMANDS = [
    "fulcrum.entrypoints.cli_generate",  # generate, chat
    "fulcrum.entrypoints.openai.cli_serve",  # serve
    "fulcrum.entrypoints.openai.run_batch",  # run-batch
    "fulcrum.bench.cli",  # bench serve|offline|cold-start
    "fulcrum.analyze.cli",  # analyze
    "fulcrum.router.cli",  # router
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fulcrum",
        description="fulcrum: an LLM inference and serving engine.",
    )
    parser.add_argument("--version", action="version", version=f"fulcrum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod_name in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and mod_name.startswith(e.name):
                continue  # subsystem not installed in this build
            raise
        mod.add_parser(sub)
    serve, analyze = sub.choices.get("serve"), sub.choices.get("analyze")
    if serve is not None and analyze is not None:
        # The analyzer recommends only flags this build's server accepts; it is told them here
        # rather than importing the server's command line.
        analyze.set_defaults(serve_flags=set(serve._option_string_actions))
    return parser


def _setup_logging() -> None:
    import logging

    from fulcrum import envs

    level = (envs.FULCRUM_LOG_LEVEL.get() or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("fulcrum")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        print(f"fulcrum {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
