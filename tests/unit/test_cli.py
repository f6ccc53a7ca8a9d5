"""The `fulcrum` command line: every subcommand has help, every flag has help text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from fulcrum.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for sub_name, subsub in _subparsers(sub):
                    yield f"{name} {sub_name}", subsub


def test_every_flag_has_help():
    names = []
    for name, sub in _subparsers(build_parser()):
        names.append(name)
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"fulcrum {name} {action.option_strings[0]} has no help text"
    for expected in ("generate", "chat", "serve", "bench", "analyze"):
        assert expected in names


def _cli(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), FULCRUM_LOG_LEVEL="WARNING")
    return subprocess.run(
        [sys.executable, "-m", "fulcrum.entrypoints.cli", *args], input=stdin, text=True,
        capture_output=True, timeout=timeout, env=env, cwd=ROOT,
    )


@pytest.mark.parametrize("cmd", [["--help"], ["generate", "--help"], ["chat", "--help"]])
def test_help_exits_zero(cmd):
    r = _cli(*cmd)
    assert r.returncode == 0 and "usage" in r.stdout.lower()


def test_generate_and_chat_on_the_embedded_model():
    r = _cli("generate", "--prompt", "What is the capital of France?", "--chat-format",
             "--temperature", "0", "--max-tokens", "12", "--kv-cache-memory", "0.1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    r = _cli("chat", "--temperature", "0", "--max-tokens", "12", "--kv-cache-memory", "0.1",
             stdin="What is the capital of France?\n/reset\n/exit\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and "(history cleared)" in r.stdout


def test_bad_flag_value_is_one_line_exit_2():
    r = _cli("generate", "--prompt", "hi", "--dtype", "float64", "--max-tokens", "2")
    assert r.returncode == 2
    assert "dtype" in r.stderr.strip().splitlines()[-1]
