"""The `fulcrum` command line: every subcommand has help, every flag has help text."""

from __future__ import annotations

import argparse
import os
import re
import signal
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


def _expanded_help(action: argparse.Action) -> str:
    return (action.help or "") % {"default": action.default, "prog": "fulcrum"}


def test_help_names_one_default_per_flag():
    for name, sub in _subparsers(build_parser()):
        for action in sub._actions:
            if action.option_strings and action.help:
                text = _expanded_help(action).lower()
                # "(default: x)", ". Default: x", "; default: x" each state one; "default model" not.
                assert len(re.findall(r"(?:^|[(.;,] ?)default\b", text)) <= 1, f"fulcrum {name} {action.option_strings[0]}: {text}"


def test_version():
    from fulcrum import __version__

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fulcrum {__version__}"


def test_bad_sampling_value_is_reported_before_the_model_loads():
    # The model does not exist: the error must be about max_tokens, found first.
    r = _cli("generate", "--prompt", "hi", "--max-tokens", "-3", "--model", "/no/such/model", timeout=60)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "max_tokens" in last and "-3" in last and "/no/such/model" not in last


class _Script:
    """Fake terminal input: lines, or exceptions to raise in their place."""

    def __init__(self, *items: object) -> None:
        self.items = list(items)

    def __call__(self, prompt: str) -> str:
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return str(item)


def test_chat_unknown_command_is_not_sent_to_the_model():
    from fulcrum.entrypoints.cli_generate import chat_loop

    seen: list[list[dict]] = []
    said: list[str] = []
    rc = chat_loop(lambda h: seen.append([dict(m) for m in h]) or "ok",
                   read=_Script("/frobnicate now", "//etc is a dir", "/exit"), out=said.append)
    assert rc == 0
    assert any("unknown command /frobnicate" in s and "/reset" in s for s in said)
    assert seen == [[{"role": "user", "content": "/etc is a dir"}]]


def test_chat_ctrl_c_cancels_the_reply_then_quits_at_the_prompt():
    from fulcrum.entrypoints.cli_generate import chat_loop

    calls: list[list[dict]] = []

    def reply(history: list[dict]) -> str:
        calls.append([dict(m) for m in history])
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while the first answer streams
        return "fine"

    said: list[str] = []
    rc = chat_loop(reply, system="be brief",
                   read=_Script("first", "second", KeyboardInterrupt()), out=said.append)
    assert rc == 0
    assert any("cancelled" in s for s in said)
    # The cancelled turn left no trace: the second request sees only the system prompt + itself.
    assert calls[1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "second"}]


def test_chat_ctrl_c_aborts_the_engine_request():
    """Ctrl-C (a real SIGINT) while a reply streams: stream_reply aborts the request between
    steps and raises KeyboardInterrupt; the engine is left idle and answers the next turn."""
    from fulcrum import SamplingParams
    from fulcrum.entrypoints.cli_generate import stream_reply
    from fulcrum.entrypoints.llm import LLM

    llm = LLM(None, kv_cache_memory=0.1, max_model_len=256)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    n = 0

    def write(_: str) -> None:
        nonlocal n
        n += 1
        if n == 3:
            os.kill(os.getpid(), signal.SIGINT)

    msgs = [{"role": "user", "content": "Count to fifty."}]
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where started in the background
    with pytest.raises(KeyboardInterrupt):
        stream_reply(llm, msgs, params, write=write)
    assert n == 3  # stopped right after the signal, not at max_tokens
    assert not llm.core.has_unfinished_requests() and not llm.processor.has_unfinished()
    assert signal.getsignal(signal.SIGINT) is before  # the handler it found is back
    again = stream_reply(llm, msgs, SamplingParams(max_tokens=4, temperature=0), write=lambda _: None)
    assert again
