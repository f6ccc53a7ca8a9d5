"""`fulcrum generate` (one-shot) and `fulcrum chat` (interactive, streaming) on one model."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from fulcrum.engine.arg_utils import EngineArgs


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="Maximum tokens to generate (default: %(default)s).")
    g.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature; 0 is greedy (default: %(default)s).")
    g.add_argument("--top-p", type=float, default=0.95, help="Nucleus sampling mass (default: %(default)s).")
    g.add_argument("--top-k", type=int, default=-1, help="Keep the k most likely tokens; -1 disables (default: %(default)s).")
    g.add_argument("--sampling-seed", type=int, default=None, help="Seed for reproducible sampling (default: random).")


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="Generate a completion for one prompt.",
                         description="Generate text for a prompt and print it.")
    gen.add_argument("--prompt", required=True, help="The prompt text.")
    gen.add_argument("--chat-format", action="store_true",
                     help="Wrap the prompt as one user message with the model's chat template.")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="Interactive terminal chat that streams tokens.",
                          description="Chat with the model in the terminal; /reset clears the "
                          "history, /exit, Ctrl-D or Ctrl-C at the prompt quits, Ctrl-C during "
                          "a reply cancels it.")
    chat.add_argument("--system", default=None, help="Optional system prompt.")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=run_chat)


def _params(args: argparse.Namespace):
    from fulcrum import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def _llm(args: argparse.Namespace):
    from fulcrum.entrypoints.llm import LLM

    ea = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(ea).items() if k != "model"}
    return LLM(ea.model, **kwargs)


def run_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # a bad sampling flag is reported before the model loads
    llm = _llm(args)
    if args.chat_format:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


@contextlib.contextmanager
def _sigint_between_steps() -> Iterator[threading.Event]:
    """Ctrl-C sets a flag the step loop checks, so an interrupt never lands inside a step (the
    scheduler's and the runner's state stay consistent for the next turn)."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_reply(llm, messages: list[dict], params, write=sys.stdout.write) -> str:
    """Run one chat turn in-process, writing text as it is produced; returns the reply.

    Ctrl-C aborts the request in the engine between steps, then raises KeyboardInterrupt."""
    from fulcrum.entrypoints.llm import resolve_max_tokens
    from fulcrum.protocol import EngineCoreRequest, to_wire

    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    rid = f"chat-{time.monotonic_ns()}"
    llm.core.add_request(EngineCoreRequest(rid, ids, to_wire(params, resolve_max_tokens(params, len(ids), llm.max_model_len))))
    llm.processor.add_request(rid, text, ids, params, stream=True)
    reply = []
    try:
        with _sigint_between_steps() as interrupted:
            while llm.core.has_unfinished_requests():
                if interrupted.is_set():
                    raise KeyboardInterrupt
                outs = llm.core.step()
                results, to_abort = llm.processor.process_outputs(outs.outputs)
                if to_abort:
                    llm.core.abort_requests(to_abort)
                for r in results:
                    delta = r.outputs[0].text
                    reply.append(delta)
                    write(delta)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        llm.core.abort_requests([rid])
        llm.processor.abort_request(rid)
        while llm.core.has_unfinished_requests():  # collect the step already launched
            llm.core.step()
        raise
    return "".join(reply)


COMMANDS = {"/reset": "clear the history", "/exit": "quit (also /quit, Ctrl-D, Ctrl-C)"}
_QUIT = ("/exit", "/quit")


def chat_loop(
    reply: Callable[[list[dict]], str],
    system: str | None = None,
    read: Callable[[str], str] = input,
    out: Callable[[str], None] = print,
) -> int:
    """The interactive loop of `fulcrum chat`, apart from the model: ``reply(history)`` streams
    one answer and returns its text. Ctrl-C during a reply cancels that turn only (the message
    is dropped from the history); Ctrl-C or Ctrl-D at the prompt quits. A line starting with
    ``/`` is a command; ``//`` sends a message that starts with ``/``."""
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    listing = ", ".join(f"{c} ({what})" for c, what in COMMANDS.items())
    out(f"fulcrum chat: type a message; commands: {listing}.")
    while True:
        try:
            line = read("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            out("")
            return 0
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            cmd = line.split()[0]
            if cmd in _QUIT:
                return 0
            if cmd == "/reset":
                history = history[:1] if system else []
                out("(history cleared)")
            else:
                out(f"unknown command {cmd}; commands: {listing}.")
            continue
        if line.startswith("//"):
            line = line[1:]
        history.append({"role": "user", "content": line})
        try:
            answer = reply(history)
        except KeyboardInterrupt:
            history.pop()
            out("\n(reply cancelled)")
            continue
        out("")
        history.append({"role": "assistant", "content": answer})


def run_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    return chat_loop(lambda history: stream_reply(llm, history, params), args.system)
