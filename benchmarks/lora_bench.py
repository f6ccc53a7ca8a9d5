"""LoRA adapters on Llama-3.1-8B (dummy bf16 weights, random PEFT adapters of rank r on every
attention and MLP projection) on one GPU: the decode step with adapter rows through the LoRA
decode graphs (``kernels/lora.py``), the same steps eager (those graphs off), and base-only
steps, at batch 1 and 32, a 512-token context.

    PYTHONPATH=src python benchmarks/lora_bench.py [--rank 16] [--adapters 4] [--batch 1 32]
        [--model llama-3.1-8b] [--device cuda]

Floor (H200, 4.28 TB/s): a decode step reads the base weights (the loaded model's parameters
but the input embedding), each adapter in the batch (2 * r * (in + out) bytes per projection,
bf16) and the batch's KV. ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_h200 import BW, Driver, _median, emit  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }  # fmt: skip


def write_adapter(path: str, cfg: dict, rank: int, seed: int) -> int:
    """A random PEFT adapter (every projection of every layer); returns its bytes in bf16."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, nbytes = {}, 0
    for layer in range(cfg["num_hidden_layers"]):
        for name, (n_in, n_out) in projections(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            a = (torch.randn(rank, n_in, generator=g) * 0.01).to(torch.bfloat16)
            b = (torch.randn(n_out, rank, generator=g) * 0.01).to(torch.bfloat16)
            tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = a, b
            nbytes += 2 * rank * (n_in + n_out)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = sorted({n.split(".")[-1] for n in projections(cfg)})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": targets, "bias": "none"}, f)  # fmt: skip
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16, help="every adapter's rank")
    ap.add_argument("--adapters", type=int, default=4, help="adapters served (and mixed)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    ap.add_argument("--model", default="llama-3.1-8b", help="a configs/ name (dummy weights)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    args = ap.parse_args()
    from fulcrum import LLM

    with open(os.path.join(CONFIGS, args.model + ".json")) as f:
        cfg = json.load(f)
    root = tempfile.mkdtemp(prefix="lora_bench_")
    names = [f"a{i}" for i in range(args.adapters)]
    adapter_bytes = 0
    for i, name in enumerate(names):
        adapter_bytes = write_adapter(os.path.join(root, name), cfg, args.rank, i)
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=4096, max_num_seqs=max(args.batch), max_num_batched_tokens=8192,
              lora_modules={n: os.path.join(root, n) for n in names})  # fmt: skip
    runner = llm.core.runner
    base_bytes = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                     if "embed_tokens" not in n or cfg.get("tie_word_embeddings"))  # fmt: skip
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2 * 2
    emit("engine", rank=args.rank, adapters=args.adapters, build_s=time.perf_counter() - t0,
         adapter_mb=adapter_bytes / 2**20, timings=runner.timings,
         graph_memory_mb={k: v / 2**20 for k, v in runner.graph_memory.items()})  # fmt: skip
    drv = Driver(llm)
    rng = random.Random(0)
    vocab = cfg["vocab_size"]

    def workload(n: int) -> list[tuple[list[int], int]]:
        return [([rng.randrange(100, vocab - 1) for _ in range(args.ctx)], args.steps + 1)
                for _ in range(n)]  # fmt: skip

    lora_graphs = runner.lora_graphs
    drv.run(workload(2), time.perf_counter() + 120, lora=["a0", None])  # warm-up
    for batch in args.batch:
        cases = {
            "base": [None] * batch,
            "one_adapter": ["a0"] * batch,
            "mixed": [([None] + names)[i % (len(names) + 1)] for i in range(batch)],
        }
        for case, lora in cases.items():
            for graphs in ([True, False] if case != "base" else [True]):
                runner.lora_graphs = lora_graphs if graphs else None
                drv.run(workload(batch), time.perf_counter() + 300, lora=lora)
                dec = [t for t, n, k, _ in drv.steps if n == k == batch]
                used = len({x for x in lora if x is not None})
                ctx = args.ctx + args.steps / 2
                floor = (base_bytes + used * adapter_bytes + batch * ctx * kv_bytes) / BW
                step = _median(dec)
                emit("lora_decode", batch=batch, case=case, lora_graphs=graphs,
                     decode_step_ms=step * 1e3, floor_ms=floor * 1e3,
                     floor_fraction=floor / step, steps=len(dec))  # fmt: skip
        runner.lora_graphs = lora_graphs


if __name__ == "__main__":
    main()
