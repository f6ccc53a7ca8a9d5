"""Speculation past ``disable_by_batch_size``: offline throughput of the same batch with and
without an n-gram (or suffix) speculative config, Llama-3.1-8B shape, dummy bf16 weights. Past
the threshold no request guesses, so the target is parity (within 2%): the steps overlap as
they do without speculation.

    PYTHONPATH=src python3 benchmarks/spec_large_batch.py [--batches 64 128] [--method ngram]
    ... --model smollm2-135m --device cpu --dtype float32 --batches 8 --input-len 16 \
        --output-len 8 --disable-by-batch-size 4                           # CPU smoke run

Prints one ``RESULT {json}`` line per batch: tokens/s of each engine and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from fulcrum import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)  # the batch's shapes, once
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="configs/ name (dummy weights).")
    ap.add_argument("--device", default="cuda", help="cuda or cpu.")
    ap.add_argument("--dtype", default="bfloat16", help="Weights' dtype.")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128], help="Batch sizes.")
    ap.add_argument("--input-len", type=int, default=512, help="Prompt tokens (random ids).")
    ap.add_argument("--output-len", type=int, default=256, help="Tokens out per request.")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"], help="Proposer.")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="The config's threshold (default: the engine's).")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(b)]
               for b in args.batches}
    spec: dict = {"method": args.method, "num_speculative_tokens": 4}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    engine = dict(load_format="dummy", device=args.device, dtype=args.dtype,
                  max_model_len=args.input_len + args.output_len + 16,
                  max_num_seqs=max(args.batches), enable_prefix_caching=False)
    results: dict[str, dict[int, float]] = {}
    for name, extra in (("none", {}), (args.method, {"speculative_config": spec})):
        llm = LLM(args.model, **engine, **extra)
        results[name] = {b: timed(llm, prompts[b], args.output_len) for b in args.batches}
        overlapped = llm.core.num_overlapped_steps
        del llm
        gc.collect()
        print(f"{name}: {results[name]} (overlapped steps {overlapped})", flush=True)
    for b in args.batches:
        base, sp = results["none"][b], results[args.method][b]
        print("RESULT " + json.dumps({"name": "spec_large_batch", "batch": b, "method": args.method,
                                      "none_tok_s": base, "spec_tok_s": sp, "ratio": sp / base}),
              flush=True)


if __name__ == "__main__":
    main()
