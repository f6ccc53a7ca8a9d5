"""Draft-model speculative decoding on the H200: decode tokens/s with and without a draft, at
concurrency 1 and a few batch sizes, beside the acceptance the run measured. Two bounds:

- ``dummy``: Llama-3.1-8B target, Llama-3.2-1B-shaped draft (configs/llama-3.2-1b.json), both
  dummy weights: the draft's guesses are noise, so acceptance is ~0 and the figure is the cost
  of drafting (the lower bound);
- ``self``: the embedded SmolLM2-135M (real weights) drafting for itself: every greedy guess is
  kept (the upper bound of acceptance; the draft costs as much as the target here).

    PYTHONPATH=src python3 benchmarks/spec_draft_gpu.py [--case dummy self] [--k 4]
        [--batches 1 8 32] [--tokens 128]
    FULCRUM_BENCH_SMOKE=1 ... runs the self case on the CPU (a dry run).

Prints one ``RESULT {json}`` line per (case, batch, spec on/off).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

from fulcrum import LLM, SamplingParams

SMOKE = int(os.environ.get("FULCRUM_BENCH_SMOKE", "0"))


def _engine(case: str, spec: dict | None) -> LLM:
    dev = {"device": "cpu", "dtype": "float32"} if SMOKE else {"device": "cuda"}
    if case == "dummy":
        kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096, **dev)
        return LLM("llama-3.1-8b", speculative_config=spec, **kw)
    return LLM(None, speculative_config=spec, **dev)


def run(case: str, k: int, batches: list[int], tokens: int) -> None:
    vocab_top = 40000 if case == "dummy" else 49000
    for spec_on in (False, True):
        draft = "llama-3.2-1b" if case == "dummy" else None
        if case == "self":
            from fulcrum.model.loader.default_model import default_model_path

            draft = default_model_path()
        spec = (
            {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
            if spec_on
            else None
        )
        llm = _engine(case, spec)
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        rng = random.Random(0)
        llm.generate([[rng.randrange(1000, vocab_top) for _ in range(64)]], sp, use_tqdm=False)
        for b in batches:
            prompts = [[rng.randrange(1000, vocab_top) for _ in range(256)] for _ in range(b)]
            before = llm.core.scheduler.spec_stats
            drafts0, acc0 = before.num_draft_tokens, before.num_accepted_tokens
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            st = llm.core.scheduler.spec_stats
            drafted = st.num_draft_tokens - drafts0
            rate = (st.num_accepted_tokens - acc0) / drafted if drafted else None
            out = dict(case=case, batch=b, spec=spec_on, k=k, tokens_per_s=b * tokens / dt,
                       seconds=dt, acceptance_rate=rate)  # fmt: skip
            print("RESULT " + json.dumps(out), flush=True)
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", nargs="+", default=["dummy", "self"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    if SMOKE:
        a.case, a.batches, a.tokens = ["self"], [1], 8
    for case in a.case:
        run(case, a.k, a.batches, a.tokens)


if __name__ == "__main__":
    main()
