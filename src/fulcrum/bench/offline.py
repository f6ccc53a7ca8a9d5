"""``fulcrum bench offline``: in-process throughput, like ``vllm bench throughput``.

The same seeded workload (token ids) runs through each ``--backend`` in one invocation:

* ``fulcrum``: ``LLM(...).generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True)])``
  over all requests at once; the engine batches them continuously.
* ``hf``: transformers ``generate`` in static batches of ``--hf-batch-size`` (left padded,
  greedy, ``min_new_tokens = max_new_tokens`` = the longest output of the batch). Its output
  tokens are counted as the requested lengths, as vLLM's ``hf`` backend counts them.

Outputs always run to their requested length (``ignore_eos``), so both backends do equal work.
Figures: elapsed seconds, requests/s, output tokens/s, total tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tqdm import tqdm

from fulcrum.bench.args import add_dataset_args, build_sessions, dataset_params, positive_int


def add_offline_parser(sub: Any) -> None:
    p = sub.add_parser(
        "offline",
        help="In-process throughput of fulcrum and/or transformers on one workload.",
        description="Offline throughput (vllm bench throughput): every request submitted at once.",
    )
    p.add_argument(
        "--backend",
        default="fulcrum",
        help="Comma list of backends to run: fulcrum, hf (default fulcrum).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Model path (HF dir, .gguf, or configs/ name for dummy); default: the embedded model.",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="Weights/activations dtype (default auto: float32 on CPU, bfloat16 on CUDA).",
    )
    p.add_argument("--device", default="auto", help="Device: auto, cpu, cuda (default auto).")
    p.add_argument(
        "--load-format",
        default=None,
        help="fulcrum weights format: safetensors, gguf, dummy (default: from the path).",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="fulcrum: running requests at most (default: engine's).",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="fulcrum: token budget per step (default: engine's).",
    )
    p.add_argument(
        "--hf-batch-size", type=positive_int, default=8, help="hf: static batch size (default 8)."
    )
    p.add_argument("--result-file", default=None, help="Write the JSON results here.")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    add_dataset_args(p, with_trace=False)
    p.set_defaults(func=run_offline)


def _requests(args: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], int]]:
    out = []
    for s in build_sessions(args, tokenizer, as_text=False):
        t = s.turns[0]
        prefix = s.system if isinstance(s.system, list) else []
        out.append((prefix + list(t.prompt), t.output_len))
    return out


def run_fulcrum(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    from fulcrum import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": args.dtype, "device": args.device}
    for key in ("load_format", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    llm = LLM(model=args.model, **kwargs)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _figures("fulcrum", reqs, n_out, elapsed)


def _hf_model(args: argparse.Namespace) -> tuple[Any, Any]:
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fulcrum.config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model is None:
        from fulcrum.model.loader.default_model import default_model_path

        path = default_model_path()
    else:
        path = args.model
    if args.load_format == "dummy":
        cfg = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    elif path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(path)),
            gguf_file=os.path.basename(path),
            torch_dtype=dtype,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return model.to(device).eval(), torch


def run_hf(
    args: argparse.Namespace, reqs: list[tuple[list[int], int]], pad_id: int
) -> dict[str, Any]:
    model, torch = _hf_model(args)
    device = next(model.parameters()).device
    bs = args.hf_batch_size
    batches = [reqs[i : i + bs] for i in range(0, len(reqs), bs)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf", unit="batch", disable=args.disable_tqdm):
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n_new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return _figures("hf", reqs, sum(n for _, n in reqs), elapsed)


def _figures(
    backend: str, reqs: list[tuple[list[int], int]], n_out: int, elapsed: float
) -> dict[str, Any]:
    n_in = sum(len(p) for p, _ in reqs)
    dur = max(elapsed, 1e-9)
    return {
        "backend": backend,
        "num_requests": len(reqs),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "elapsed_s": elapsed,
        "request_throughput": len(reqs) / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }


def run_offline(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    bad = [b for b in backends if b not in ("fulcrum", "hf")]
    if bad or not backends:
        print(
            f"fulcrum bench offline: error: unknown backend {bad[0] if bad else ''!r}; use fulcrum, hf.",
            file=sys.stderr,
        )
        return 2
    try:
        from fulcrum.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        reqs = _requests(args, tokenizer)
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        runs = []
        for b in backends:
            fig = run_fulcrum(args, reqs) if b == "fulcrum" else run_hf(args, reqs, int(pad or 0))
            runs.append(fig)
    except ValueError as e:
        print(f"fulcrum bench offline: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(
        f"{'backend':<9} {'requests':>8} {'in tok':>8} {'out tok':>8} {'time s':>8} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10}"
    )
    for r in runs:
        print(
            f"{r['backend']:<9} {r['num_requests']:>8} {r['total_input_tokens']:>8} "
            f"{r['total_output_tokens']:>8} {r['elapsed_s']:>8.2f} {r['request_throughput']:>8.2f} "
            f"{r['output_throughput']:>10.1f} {r['total_token_throughput']:>10.1f}"
        )
    if args.result_file:
        doc = {
            "schema": "fulcrum.bench.offline/1",
            "model": args.model or "default",
            "dataset": dataset_params(args),
            "seed": args.seed,
            "runs": runs,
        }
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"results: {args.result_file}")
    return 0
