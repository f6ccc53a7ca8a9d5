"""`fulcrum generate` (one-shot) and `fulcrum chat` (interactive, streaming) on one model."""

from __future__ import annotations

import argparse
import sys
import time

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
                          "history, /exit or Ctrl-D quits.")
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
    llm = _llm(args)
    params = _params(args)
    if args.chat_format:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def stream_reply(llm, messages: list[dict], params, write=sys.stdout.write) -> str:
    """Run one chat turn in-process, writing text as it is produced; returns the reply."""
    from fulcrum.entrypoints.llm import resolve_max_tokens
    from fulcrum.protocol import EngineCoreRequest, to_wire

    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    rid = f"chat-{time.monotonic_ns()}"
    llm.core.add_request(EngineCoreRequest(rid, ids, to_wire(params, resolve_max_tokens(params, len(ids), llm.max_model_len))))
    llm.processor.add_request(rid, text, ids, params, stream=True)
    reply = []
    while llm.core.has_unfinished_requests():
        outs = llm.core.step()
        results, to_abort = llm.processor.process_outputs(outs.outputs)
        if to_abort:
            llm.core.abort_requests(to_abort)
        for r in results:
            delta = r.outputs[0].text
            reply.append(delta)
            write(delta)
            sys.stdout.flush()
    return "".join(reply)


def run_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _params(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("fulcrum chat: type a message; /reset clears the history, /exit quits.", flush=True)
    while True:
        try:
            line = input("\n> ")
        except EOFError:
            print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": line})
        reply = stream_reply(llm, history, params)
        print(flush=True)
        history.append({"role": "assistant", "content": reply})
