"""Encoder embedding throughput (BERT-base shapes, random weights) beside transformers.

Workload (seeded): N prompts of uniform random length in [--min-len, --max-len] token ids.
fulcrum embeds all of them at once (``LLM.embed``: whole prompts packed into steps of up to
``--max-num-batched-tokens`` tokens, one padded attention batch per step); transformers runs
``BertModel`` over length-sorted batches of ``--hf-batch-size`` (padded, attention mask), CLS
pooling. Both in float32 on the CPU (or bfloat16 on CUDA with ``--device cuda``). Reports
prompts/s and prompt tokens/s, and the largest difference between the two's vectors.

    python benchmarks/encoder_embed.py [--num 512] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import numpy as np
import torch


def make_model(path: str) -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512)  # fmt: skip
    BertModel(cfg, add_pooling_layer=False).save_pretrained(path)


def workload(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[101] + [rng.randrange(1000, 30000) for _ in range(rng.randint(lo, hi) - 2)] + [102]
            for _ in range(n)]  # fmt: skip


def run_fulcrum(path: str, prompts: list[list[int]], args) -> tuple[dict, np.ndarray]:
    from fulcrum import LLM

    t0 = time.perf_counter()
    llm = LLM(path, device=args.device, dtype=args.dtype, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, embedding_normalize="off")  # fmt: skip
    load = time.perf_counter() - t0
    llm.embed(prompts[:4], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    dt = time.perf_counter() - t0
    vecs = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
    return {"engine": "fulcrum", "load_s": load, "seconds": dt}, vecs


def run_hf(path: str, prompts: list[list[int]], args) -> tuple[dict, np.ndarray]:
    from transformers import BertModel

    dtype = getattr(torch, args.dtype)
    model = BertModel.from_pretrained(path, dtype=dtype, add_pooling_layer=False)
    model = model.to(args.device).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    vecs = np.zeros((len(prompts), model.config.hidden_size), dtype=np.float32)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), args.hf_batch_size):
            idx = order[s : s + args.hf_batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, : len(prompts[i])] = 1
            out = model(ids.to(args.device), attention_mask=mask.to(args.device))
            vecs[idx] = out.last_hidden_state[:, 0].float().cpu().numpy()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return {"engine": "transformers", "seconds": time.perf_counter() - t0}, vecs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num", type=int, default=512, help="prompts (default 512)")
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt (default 16)")
    ap.add_argument("--max-len", type=int, default=256, help="longest prompt (default 256)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="fulcrum's step budget (default 8192)")  # fmt: skip
    ap.add_argument("--hf-batch-size", type=int, default=32, help="transformers' batch (default 32)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    prompts = workload(args.num, args.min_len, args.max_len, args.seed)
    tokens = sum(len(p) for p in prompts)
    results = []
    with tempfile.TemporaryDirectory() as path:
        make_model(path)
        ours, a = run_fulcrum(path, prompts, args)
        theirs, b = run_hf(path, prompts, args)
    for r in (ours, theirs):
        r.update(prompts_s=args.num / r["seconds"], tokens_s=tokens / r["seconds"])
        results.append(r)
        print(f"{r['engine']:>12}: {r['seconds']:.2f} s, {r['prompts_s']:.1f} prompts/s, "
              f"{r['tokens_s']:.0f} tokens/s")  # fmt: skip
    diff = float(np.abs(a - b).max())
    print(f"prompts {args.num}, tokens {tokens}; largest vector difference {diff:.2e}; "
          f"fulcrum / transformers: {ours['prompts_s'] / theirs['prompts_s']:.2f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "max_diff": diff, "results": results}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
