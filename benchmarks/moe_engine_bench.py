"""Mixture-of-experts engines on one H200 with dummy weights: single-stream ITL at a 1,000-token
context and N x 1,000/1,000 offline throughput, each beside its floor, fused MoE kernels on (and,
with ``--compare-torch``, the ITL with them off: every expert on every row inside the graphs).

    PYTHONPATH=src python benchmarks/moe_engine_bench.py [--model qwen3-30b-a3b mixtral-8x7b]
        [--fp8] [--num 1000] [--max-num-seqs 256] [--cap 500] [--compare-torch]

Floors (4.28 TB/s): a decode step of batch B reads the non-expert weights (attention, router,
LM head), the weights of every expert its tokens pick (about E * (1 - (1 - k/E)^B) experts per
layer for random routing) and every cached K/V row of the batch. ``RESULT {json}`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_h200 import Driver, _median, emit  # noqa: E402

BW = 4.28e12
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class Shape:
    """The bytes a decode step reads, from the model's config.json."""

    def __init__(self, model: str, weight_bytes: int) -> None:
        with open(os.path.join(CONFIGS, model + ".json")) as fh:
            c = json.load(fh)
        self.vocab = c["vocab_size"]
        h, layers = c["hidden_size"], c["num_hidden_layers"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c.get("head_dim") or h // heads
        self.e = c.get("num_local_experts") or c["num_experts"]
        self.k = c["num_experts_per_tok"]
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        shared = c.get("shared_expert_intermediate_size") or 0
        wb = weight_bytes
        attn = (h * heads * d * 2 + h * kv * d * 2) * wb
        self.dense = layers * (attn + 3 * h * shared * wb + h * self.e * 2) + h * self.vocab * 2
        self.expert = layers * 3 * h * inter * wb
        self.kv_per_token = layers * kv * d * 2 * 2  # bf16 cache

    def floor_s(self, batch: int, mean_ctx: float) -> float:
        active = self.e * (1 - (1 - self.k / self.e) ** batch)
        return (self.dense + active * self.expert + batch * mean_ctx * self.kv_per_token) / BW


def workload(n: int, n_in: int, n_out: int, vocab: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 1) for _ in range(n_in)], n_out) for _ in range(n)]


def run_model(model: str, args) -> None:
    import torch

    from fulcrum import LLM

    shape = Shape(model, 1 if args.fp8 else 2)
    t_end = time.perf_counter() + args.cap
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=4096,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
              quantization="fp8" if args.fp8 else None)  # fmt: skip
    emit("engine", model=model, fp8=args.fp8, build_s=time.perf_counter() - t0,
         kv_tokens=llm.core.num_kv_tokens, gpu_gib=torch.cuda.memory_allocated() / 2**30)  # fmt: skip
    drv = Driver(llm)
    drv.run(workload(8, 300, 16, shape.vocab, 99), t_end)  # warm-up
    kcs = [True, False] if args.compare_torch else [True]
    for fused in kcs:
        kc = llm.core.runner.kernel_config.replace(fused_moe=fused)
        llm.core.runner.model.set_kernel_config(kc)
        if llm.core.runner.graphs is not None and not fused:
            llm.core.runner.use_cuda_graphs = False  # graphs hold the fused launches
        r = drv.run(workload(1, 1000, 129, shape.vocab, 1), t_end)
        itl = _median([t for t, n, k, _ in drv.steps if n == k == 1])
        floor = shape.floor_s(1, 1064)
        emit("itl_1000ctx", model=model, fp8=args.fp8, fused_moe=fused,
             cuda_graphs=llm.core.runner.use_cuda_graphs, decode_step_ms=itl * 1e3,
             floor_ms=floor * 1e3, floor_fraction=floor / itl)  # fmt: skip
    llm.core.runner.model.set_kernel_config(llm.core.runner.kernel_config)
    llm.core.runner.use_cuda_graphs = llm.core.runner.graphs is not None
    left = t_end - time.perf_counter()
    r = drv.run(workload(args.num, 1000, 1000, shape.vocab, 7), time.perf_counter() + left - 5)
    dec = [(t, n, c) for t, n, k, c in drv.steps if n == k]
    fracs = [shape.floor_s(n, c / n) / t for t, n, c in dec]
    r = {k: v for k, v in r.items() if not k.startswith("decode_floor")}  # the 8B's floor
    emit("throughput_1000x1000", model=model, fp8=args.fp8, **r,
         decode_floor_fraction_median=_median(fracs))  # fmt: skip
    del llm, drv
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"])
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (experts included)")
    ap.add_argument("--num", type=int, default=1000, help="requests of the throughput run")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--cap", type=float, default=500.0, help="seconds per model")
    ap.add_argument("--compare-torch", action="store_true", help="ITL with fused_moe off too")
    args = ap.parse_args()
    for model in args.model:
        run_model(model, args)


if __name__ == "__main__":
    main()
