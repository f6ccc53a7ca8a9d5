"""Engine throughput on the CPU with the embedded SmolLM2-135M, beside transformers.

Workload (seeded): N requests, prompt lengths uniform in [32, 512], output lengths uniform in
[16, 256], random in-vocabulary token ids, ``ignore_eos`` so every engine does the same work.
Reports output tokens/s of fulcrum (all requests submitted together), transformers ``generate``
with one static batch of all requests (left-padded; runs to the longest output; only requested
tokens count), and transformers with batch 1 (a sub-sample), plus peak RSS and load times.

    python benchmarks/engine_cpu.py [--num-requests 64] [--hf-single 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def run_fulcrum(reqs, args) -> dict:
    from fulcrum import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(dtype="float32", device="cpu", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=256, kv_cache_memory=4)
    load = time.perf_counter() - t0
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([p for p, _ in reqs[:2]], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs)
    return {"engine": "fulcrum", "load_s": load, "seconds": dt, "output_tokens": n_out,
            "output_tok_s": n_out / dt, "peak_rss_gib": peak_rss_gib()}


def run_fulcrum_single(reqs) -> dict:
    """One request at a time (single stream), on the sub-sample HF batch 1 uses."""
    from fulcrum import LLM, SamplingParams

    llm = LLM(dtype="float32", device="cpu", kv_cache_memory=1)
    llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    total, n_out = 0.0, 0
    for p, o in reqs:
        t0 = time.perf_counter()
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=o, ignore_eos=True),
                           use_tqdm=False)
        total += time.perf_counter() - t0
        n_out += len(out[0].outputs[0].token_ids)
    return {"engine": "fulcrum-batch1", "seconds": total, "output_tokens": n_out,
            "output_tok_s": n_out / total, "requests": len(reqs)}


def run_hf(reqs, batch: int, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    total_time, n_out = 0.0, 0
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(o for _, o in chunk)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
        total_time += time.perf_counter() - t0
        n_out += sum(o for _, o in chunk)
    return {"engine": f"hf-generate-batch{batch}", "load_s": load, "seconds": total_time,
            "output_tokens": n_out, "output_tok_s": n_out / total_time, "requests": len(reqs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64, help="Requests in the workload.")
    ap.add_argument("--hf-single", type=int, default=8, help="Requests sub-sampled for HF batch 1.")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="fulcrum step budget.")
    ap.add_argument("--seed", type=int, default=0, help="Workload seed.")
    ap.add_argument("--skip-hf", action="store_true", help="Only run fulcrum.")
    ap.add_argument("--only-single", action="store_true",
                    help="Only the single-stream comparison (fulcrum and HF, batch 1).")
    ap.add_argument("--json", default=None, help="Write results to this file.")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    reqs = workload(args.num_requests, args.seed)
    results = []
    if not args.only_single:
        results.append(run_fulcrum(reqs, args))
        print(json.dumps(results[-1]), flush=True)
    results.append(run_fulcrum_single(reqs[: args.hf_single]))
    print(json.dumps(results[-1]), flush=True)
    if not args.skip_hf:
        from fulcrum.model.loader.default_model import default_model_path
        from fulcrum.model.loader.gguf_loader import convert_gguf

        model_dir = convert_gguf(default_model_path())
        if not args.only_single:
            results.append(run_hf(reqs, len(reqs), model_dir))
            print(json.dumps(results[-1]), flush=True)
        results.append(run_hf(reqs[: args.hf_single], 1, model_dir))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"workload": {"num_requests": args.num_requests, "seed": args.seed,
                                    "input_tokens": sum(len(p) for p, _ in reqs),
                                    "output_tokens": sum(o for _, o in reqs)},
                       "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
