"""Llama-3.1-8B (dummy weights, bf16) on one H200: throughput, latency, prefill, cold start, and
transformers on a sub-sample of the same workload, each beside its physical floor.

    python benchmarks/gpu_h200.py --out DIR [--deadline 500]

Phases run as separate processes, each with a time cap (a phase that runs out stops and says
so): ``tests`` (tests/gpu), ``fulcrum`` (single-stream ITL with and without CUDA graphs and
asynchronous scheduling, TTFT, 128/128, 64 x 1000/128, 2048/128, 1000/1000), ``fp8`` (the same
engine with an FP8 KV cache and 512 sequences: ITL and 1000/1000), ``hf`` (transformers
``generate`` static batch and ``generate_batch``), ``cold`` (process start to first token);
on request (``--only``): ``fp8w`` (FP8 weights and KV cache: ITL, TTFT, 1000/1000) and
``fp8w70b`` (Llama-3.3-70B in FP8: ITL and 256 x 1000/1000), ``int4w`` and ``int4w70b`` (the
same with INT4 GPTQ-layout weights, group 128).
Every result is a ``RESULT {json}`` line in DIR/<phase>.log; all of them end in DIR/bench.json.

Floors (H200: 4.28 TB/s copy, 790 TFLOP/s bf16): a decode step of batch B at mean context C
costs >= (15.0e9 + B*C*131072) / 4.28e12 s; prefill >= 2 * 7.5e9 FLOPs per token / 790e12.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback

MODEL = "llama-3.1-8b"
BW, FLOPS, WEIGHT_BYTES, KV_BYTES, PARAMS = 4.28e12, 790e12, 15.0e9, 131072, 7.5e9
ENGINE = dict(
    load_format="dummy",
    dtype="bfloat16",
    device="cuda",
    max_model_len=4096,
    max_num_seqs=384,
    max_num_batched_tokens=8192,
)
FP8_MAX_NUM_SEQS = 512  # the FP8-KV phase (throughput_ab.py --max-num-seqs: 384 vs 512)
# FP8-weight phases: the model, its engine settings, and the bytes a decode step reads at least
# (FP8 projections + the bf16 LM head; FP8 KV bytes per token: layers x kv heads x head_dim x 2).
FP8W = {
    "fp8w": dict(
        model="llama-3.1-8b",
        weight_bytes=6.98e9 + 1.05e9,
        kv_bytes=65536,
        params=7.5e9,
        engine=dict(quantization="fp8", kv_cache_dtype="fp8", max_num_seqs=512),
        long=(1000, 1000, 1000),
    ),
    "fp8w70b": dict(
        model="llama-3.3-70b",
        weight_bytes=68.45e9 + 2.1e9,
        kv_bytes=163840,
        params=70.6e9,
        engine=dict(quantization="fp8", kv_cache_dtype="fp8", max_num_seqs=128),
        long=(256, 1000, 1000),
    ),
    # INT4 weights (GPTQ layout, group 128, dummy packed words): the projections' words plus a
    # fp16 scale and a byte zero per 128 weights, and the bf16 LM head.
    "int4w": dict(
        model="llama-3.1-8b",
        weight_bytes=6.98e9 * (0.5 + 3 / 128) + 1.05e9,
        kv_bytes=65536,
        params=7.5e9,
        engine=dict(quantization="gptq", kv_cache_dtype="fp8", max_num_seqs=512),
        long=(1000, 1000, 1000),
    ),
    "int4w70b": dict(
        model="llama-3.3-70b",
        weight_bytes=68.45e9 * (0.5 + 3 / 128) + 2.1e9,
        kv_bytes=163840,
        params=70.6e9,
        engine=dict(quantization="gptq", kv_cache_dtype="fp8", max_num_seqs=256),
        long=(256, 1000, 1000),
    ),
}
# FULCRUM_BENCH_SMOKE=N: a CPU dry run of the fulcrum phase (SmolLM2 shape, workloads / N).
SMOKE = int(os.environ.get("FULCRUM_BENCH_SMOKE", "0"))
if SMOKE:
    MODEL = "smollm2-135m"
    ENGINE = dict(
        ENGINE,
        dtype="float32",
        device="cpu",
        max_model_len=512,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        kv_cache_memory=1.0,
    )


LONG = (1000, 1000, 1000)  # requests, input, output of bench_long_throughput


def decode_floor_s(batch: int, mean_ctx: float) -> float:
    return (WEIGHT_BYTES + batch * mean_ctx * KV_BYTES) / BW


def prefill_floor_s(tokens: int) -> float:
    return 2 * PARAMS * tokens / FLOPS


def capture_graph(fn):
    """``fn`` run once (warm-up), then captured in a new CUDA graph, which is returned."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_ms(graph, iters: int) -> float:
    """Mean device time of one replay of ``graph`` over ``iters`` back-to-back replays, in ms."""
    import torch

    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def emit(name: str, **data) -> None:
    print("RESULT " + json.dumps({"name": name, **data}), flush=True)


def workload(n: int, n_in: int, n_out: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if SMOKE:
        n, n_in, n_out = max(1, n // SMOKE), max(4, n_in // SMOKE), max(2, n_out // SMOKE)
    top = 40000 if SMOKE else 120000
    return [([rng.randrange(1000, top) for _ in range(n_in)], n_out) for _ in range(n)]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


# -- fulcrum ------------------------------------------------------------------------------------


class Driver:
    """Runs requests through an ``LLM``'s engine step by step, with a deadline and step records.

    Each launched batch is recorded as (wall seconds of the engine step that launched it, reqs,
    tokens, context); with asynchronous scheduling a step's wall time is the device time of the
    batch before it plus whatever host work did not overlap, so in a steady run it is the true
    cost of one step."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.steps: list[tuple[float, int, int, int]] = []  # (seconds, reqs, tokens, context)
        self._launched: list[tuple[int, int, int]] = []
        runner = llm.core.runner
        orig = runner.execute_async

        def execute_async(out, *args):
            n, tok = out.num_reqs, out.num_batched_tokens
            self._launched.append((n, tok, sum(out.num_computed_tokens) + tok))
            return orig(out, *args)

        runner.execute_async = execute_async

    def step(self):
        """One engine step; books its wall time against the batch it launched."""
        k = len(self._launched)
        t0 = time.perf_counter()
        outs = self.llm.core.step()
        dt = time.perf_counter() - t0
        if len(self._launched) > k:
            self.steps.append((dt, *self._launched[-1]))
        return outs, dt

    def run(
        self,
        reqs: list[tuple[list[int], int]],
        deadline: float,
        sampling: dict | None = None,
        lora: list[str | None] | None = None,
    ) -> dict:
        """Every request to completion (or the deadline); greedy unless ``sampling`` gives
        other ``SamplingParams`` fields; ``lora``: each request's adapter (None: the base)."""
        from fulcrum import SamplingParams

        llm, core = self.llm, self.llm.core
        self.steps.clear()
        kw = dict(temperature=0, ignore_eos=True) | (sampling or {})
        names = lora if lora is not None else [None] * len(reqs)
        ids = [
            llm._add(p, SamplingParams(max_tokens=o, **kw), 0, name)
            for (p, o), name in zip(reqs, names, strict=True)
        ]
        n_out, done, step_s, first_tok = 0, 0, [], None
        n_exec, by_kind = 0, {}  # kind -> [steps, seconds of whole engine steps]
        nvml: dict[str, list[tuple[int, int]]] = {}  # kind -> (SM MHz, W) every 16th step
        retries0 = _alloc_retries()
        prompt0 = core.get_stats().prompt_tokens_total
        t0 = time.perf_counter()
        complete = True
        while core.has_unfinished_requests():
            ts = time.perf_counter()
            outs, _ = self.step()
            results, _ = llm.processor.process_outputs(outs.outputs)
            step_s.append(time.perf_counter() - ts)
            if len(self.steps) > n_exec:  # the step launched a batch: book its time by kind
                n_exec = len(self.steps)
                _, n, tok, _ = self.steps[-1]
                kind = "decode" if tok == n else "prefill/mixed"
                by_kind.setdefault(kind, [0, 0.0])
                by_kind[kind][0] += 1
                by_kind[kind][1] += step_s[-1]
                if n_exec % 16 == 0 and (sample := clock_power()) is not None:
                    nvml.setdefault(kind, []).append(sample)
            n_new = sum(len(o.new_token_ids) for o in outs.outputs)
            if n_new and first_tok is None:
                first_tok = time.perf_counter() - t0
            n_out += n_new
            done += sum(1 for r in results if r.finished)
            if time.perf_counter() > deadline:
                complete = False
                core.abort_requests(ids)
                for rid in ids:
                    llm.processor.abort_request(rid)
                while core.has_unfinished_requests():
                    core.step()
                break
        dt = time.perf_counter() - t0
        n_in = core.get_stats().prompt_tokens_total - prompt0
        dec = [s for s in self.steps if s[2] == s[1]]  # pure decode: one token per request
        stats = {}
        if dec:
            ratios = [decode_floor_s(n, c / n) / t for t, n, _, c in dec]
            stats = {
                "decode_steps": len(dec),
                "decode_step_ms_median": 1e3 * _median([t for t, *_ in dec]),
                "decode_batch_median": _median([n for _, n, _, _ in dec]),
                "decode_ctx_mean": sum(c for *_, c in dec) / sum(n for _, n, _, _ in dec),
                "decode_floor_fraction_median": _median(ratios),
            }
        return {
            "requests": len(reqs),
            "completed": done,
            "complete": complete,
            "seconds": dt,
            "output_tokens": n_out,
            "output_tok_s": n_out / dt,
            "total_tok_s": (n_out + n_in) / dt,
            "ttft_s": first_tok,
            "step_ms_median": 1e3 * _median(step_s[1:]),
            "steps_by_kind": by_kind,
            "alloc_retries": _alloc_retries() - retries0,
            **stats,
            **({"sm_mhz_and_watts_median": {k: _median_pair(v) for k, v in nvml.items()}}
               if nvml else {}),
        }  # fmt: skip


def clock_power() -> tuple[int, int] | None:
    """The device's SM clock (MHz) and power draw (W) now, from NVML; None without it. A
    compute-bound step that draws the power cap runs below the 1,980 MHz that 790 TFLOP/s
    assumes."""
    import torch

    try:
        return torch.cuda.clock_rate(), round(torch.cuda.power_draw() / 1000)
    except Exception:  # noqa: BLE001  (no NVML here: pynvml missing, or no GPU)
        return None


def _median_pair(v: list[tuple[int, int]]) -> list[float]:
    return [_median([a for a, _ in v]), _median([b for _, b in v])]


def _alloc_retries() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def _budget_gib(llm) -> float | None:
    """The device memory ``gpu_memory_utilization`` allows the engine."""
    import torch

    if not torch.cuda.is_available():
        return None
    util = llm.config.cache_config.gpu_memory_utilization
    return torch.cuda.mem_get_info()[1] * util / 2**30


def _gpu_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_used_gib": (total - free) / 2**30,
    }


def phase_fulcrum(cap: float, kv_cache_dtype: str = "auto", fp8w: str | None = None) -> None:
    """The bf16 engine (all sections), with an FP8 KV cache (latency and 1,000/1,000), or one of
    the FP8-weight setups of ``FP8W``."""
    import logging

    from fulcrum import LLM

    global MODEL, WEIGHT_BYTES, KV_BYTES, PARAMS, LONG
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t_end = time.perf_counter() + cap
    t0 = time.perf_counter()
    engine = {**ENGINE, "kv_cache_dtype": kv_cache_dtype}
    if kv_cache_dtype == "fp8" and not SMOKE:
        # Twice the tokens fit (1.79M): 512 sequences of 2,000 tokens run without preemption,
        # which a bf16 cache (0.89M tokens) cannot hold.
        engine["max_num_seqs"] = FP8_MAX_NUM_SEQS
    if fp8w is not None:
        setup = FP8W[fp8w]
        engine.update(setup["engine"])
        if not SMOKE:
            MODEL, WEIGHT_BYTES, KV_BYTES = setup["model"], setup["weight_bytes"], setup["kv_bytes"]
            PARAMS, LONG = setup["params"], setup["long"]
        else:
            engine["max_num_seqs"] = ENGINE["max_num_seqs"]
    llm = LLM(MODEL, **engine)
    runner = llm.core.runner
    emit(
        "engine",
        build_s=time.perf_counter() - t0,
        timings=runner.timings,
        graph_memory_mib={k: v / 2**20 for k, v in runner.graph_memory.items()},
        budget_gib=_budget_gib(llm),
        **_gpu_memory(),
        kv_tokens=llm.core.num_kv_tokens,
        graphs=runner.graphs.sizes if runner.graphs else None,
        config=engine,
    )
    drv = Driver(llm)
    fp8 = kv_cache_dtype != "auto"
    sections = (
        (bench_itl, bench_long_throughput) if fp8 else (bench_itl, bench_prefill, bench_throughput)
    )
    if fp8w is not None:
        sections = (bench_itl, bench_prefill, bench_long_throughput)
    for section in sections:
        try:
            section(drv, t_end)
        except Exception as e:  # keep the other sections' numbers
            traceback.print_exc()
            emit(section.__name__, error=f"{type(e).__name__}: {e}"[:500])


SAMPLED = dict(temperature=0.8, top_p=0.95)  # a chat client's usual settings


def bench_itl(drv: Driver, t_end: float) -> None:
    """b. Single stream at a 1,000-token context: CUDA graphs with and without asynchronous
    scheduling, and eager (same engine), greedy; then graphs and asynchronous scheduling with
    temperature and top-p sampling (drawn inside the decode graph, ``sample_in_graph``)."""
    core = drv.llm.core
    runner = core.runner
    drv.run(workload(8, 300, 16, 99), t_end)  # warm-up: prefill and mixed-step variants
    default_async = core.async_scheduling
    cases = ((True, True, None), (True, False, None), (False, True, None), (True, True, SAMPLED))
    for i, (graphs, overlap, sampling) in enumerate(cases):
        runner.use_cuda_graphs = graphs and runner.graphs is not None
        core.async_scheduling = overlap
        r = drv.run(workload(1, 1000, 129, 1 + i), t_end, sampling)
        itl = _median([t for t, n, k, _ in drv.steps if n == k == 1]) * 1e3
        floor = decode_floor_s(1, 1064) * 1e3
        emit(
            "itl_1000ctx",
            sampling="greedy" if sampling is None else "t0.8 top-p 0.95",
            cuda_graphs=runner.use_cuda_graphs,
            async_scheduling=overlap,
            step_ms=r["step_ms_median"],
            decode_step_ms=itl,
            floor_ms=floor,
            floor_fraction=floor / r["step_ms_median"],
        )
    runner.use_cuda_graphs = runner.graphs is not None
    core.async_scheduling = default_async


def bench_prefill(drv: Driver, t_end: float) -> None:
    """c. TTFT of one 1,000-token prompt and of one 128-token prompt (where launching the
    step's kernels, not the GPU, can bound it; fresh prompts: no prefix hits); an 8k-token step."""
    for n_in in (1000, 128):
        runs = [drv.run(workload(1, n_in, 1, 10 + i), t_end)["seconds"] for i in range(3)]
        ttft = _median(runs)
        emit(
            f"ttft_{n_in}",
            ttft_ms=ttft * 1e3,
            floor_ms=prefill_floor_s(n_in) * 1e3,
            flops_fraction=prefill_floor_s(n_in) / ttft,
        )
    r = drv.run(workload(8, 1000, 1, 20), t_end)
    emit(
        "prefill_8x1000",
        seconds=r["seconds"],
        tok_s=8000 / r["seconds"],
        flops_fraction=prefill_floor_s(8000) / r["seconds"],
    )


def bench_throughput(drv: Driver, t_end: float) -> None:
    """a. Offline throughput; the last workload gets whatever time the phase has left."""
    import torch

    plan = [
        ("128/128", 1000, 128, 128, 40),
        ("1000/128 (hf sub-sample)", 64, 1000, 128, 30),
        ("2048/128 (sub-sample)", 256, 2048, 128, 40),
        ("1000/1000", 1000, 1000, 1000, 1e9),
    ]
    for name, n, n_in, n_out, own_cap in plan:
        left = t_end - time.perf_counter()
        if left < 5:
            emit("throughput", workload=name, skipped="phase time cap")
            continue
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        r = drv.run(workload(n, n_in, n_out, 7), time.perf_counter() + min(own_cap, left - 2))
        emit("throughput", workload=name, **r, **_gpu_memory())


def bench_long_throughput(drv: Driver, t_end: float) -> None:
    """a. The 1,000/1,000 workload alone (the FP8 KV cache run)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    n, n_in, n_out = LONG
    r = drv.run(workload(n, n_in, n_out, 7), t_end - 2)
    emit("throughput", workload=f"{n} x {n_in}/{n_out}", **r, **_gpu_memory())


# -- transformers -------------------------------------------------------------------------------


def phase_hf(cap: float) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t_end = time.perf_counter() + cap
    here = os.path.dirname(os.path.abspath(__file__))
    cfg = LlamaConfig.from_json_file(os.path.join(here, "..", "configs", f"{MODEL}.json"))
    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.cuda.synchronize()
    emit("hf_init", seconds=time.perf_counter() - t0)
    reqs = workload(64, 1000, 128, 7)
    ids = torch.tensor([p for p, _ in reqs], device="cuda")
    with torch.no_grad():
        model.generate(
            ids[:2, :32],
            attention_mask=torch.ones_like(ids[:2, :32]),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=128,
            min_new_tokens=128,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    emit(
        "hf_generate_static",
        requests=64,
        n_in=1000,
        n_out=128,
        seconds=dt,
        output_tok_s=64 * 128 / dt,
        total_tok_s=64 * 1128 / dt,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
    )
    if not hasattr(model, "generate_batch"):
        emit("hf_generate_batch", unavailable="no generate_batch in this transformers")
        return
    if t_end - time.perf_counter() < 10:
        emit("hf_generate_batch", skipped="phase time cap")
        return
    try:
        gen = GenerationConfig(
            max_new_tokens=128, do_sample=False, pad_token_id=0, eos_token_id=cfg.eos_token_id
        )
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=[p for p, _ in reqs], generation_config=gen)
        dt = time.perf_counter() - t0
        n_out = sum(len(v.generated_tokens) for v in out.values())
        emit(
            "hf_generate_batch",
            requests=64,
            n_in=1000,
            n_out=128,
            seconds=dt,
            output_tokens=n_out,
            output_tok_s=n_out / dt,
            total_tok_s=(n_out + 64000) / dt,
        )
    except Exception as e:  # report, don't fail the run
        emit("hf_generate_batch", unavailable=f"{type(e).__name__}: {e}"[:500])


# -- cold start ---------------------------------------------------------------------------------

COLD = """
import json, logging, os, time
t_import = time.time()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
import sys
from fulcrum import LLM, SamplingParams
llm = LLM({model!r}, **{engine!r})
t_ready = time.time()
llm.generate([[1000 + i for i in range(16)]], SamplingParams(temperature=0, max_tokens=1,
             ignore_eos=True), use_tqdm=False)
t_first = time.time()
t0 = float(os.environ["T_SPAWN"])
cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
compiled = len(os.listdir(cache)) if os.path.isdir(cache) else 0
print("RESULT " + json.dumps(dict(name="cold_start", to_first_token_s=t_first - t0,
      interpreter_start_s=t_import - t0, engine_ready_s=t_ready - t0,
      triton_cache_dir=cache, triton_cache_entries=compiled,
      **llm.core.runner.timings)), flush=True)
"""


# -- orchestration ------------------------------------------------------------------------------


def run_phase(name: str, cmd: list[str], cap: float, out_dir: str, env: dict) -> list[dict]:
    """Run ``cmd`` for at most ``cap`` seconds, streaming its output to DIR/<name>.log."""
    print(f"== phase {name} (cap {cap:.0f} s)", flush=True)
    results: list[dict] = []
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("RESULT "):
                    results.append(json.loads(line[7:]))
                    print(line, end="", flush=True)
                elif name == "tests" or "Captured" in line or "Error" in line:
                    print("  " + line, end="", flush=True)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        th.join(timeout=5)
    results.append({"name": f"{name}_exit", "rc": rc})
    print(f"== phase {name} done: rc={rc}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=500.0, help="whole run, seconds")
    ap.add_argument("--phase", choices=["fulcrum", "fp8", *FP8W, "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--cap", type=float, default=200.0, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="", help="comma-separated phases to skip")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated phases to run instead of the default set (fp8w and fp8w70b run "
        "only when named here)",
    )
    args = ap.parse_args()
    if args.phase == "fulcrum":
        return phase_fulcrum(args.cap)
    if args.phase == "fp8":
        return phase_fulcrum(args.cap, kv_cache_dtype="fp8")
    if args.phase in FP8W:
        return phase_fulcrum(args.cap, kv_cache_dtype="fp8", fp8w=args.phase)
    if args.phase == "hf":
        return phase_hf(args.cap)
    os.makedirs(args.out, exist_ok=True)
    t_end = time.perf_counter() + args.deadline
    me, py = os.path.abspath(__file__), sys.executable
    pytest = [py, "-m", "pytest", "tests/gpu", "-q", "-rs"]
    plan = [  # (name, command, cap in seconds; None: what the later phases leave)
        ("tests", [*pytest, "-p", "no:cacheprovider"], 170.0),  # 18 tests: ~125 s on an H200
        ("fulcrum", [py, me, "--out", args.out, "--phase", "fulcrum"], None),
        ("fp8", [py, me, "--out", args.out, "--phase", "fp8"], 130.0),
        ("hf", [py, me, "--out", args.out, "--phase", "hf"], 80.0),
        ("cold", [py, "-c", COLD.format(model=MODEL, engine=ENGINE)], 70.0),
        ("fp8w", [py, me, "--out", args.out, "--phase", "fp8w"], 200.0),
        ("fp8w70b", [py, me, "--out", args.out, "--phase", "fp8w70b"], None),
        ("int4w", [py, me, "--out", args.out, "--phase", "int4w"], 200.0),
        ("int4w70b", [py, me, "--out", args.out, "--phase", "int4w70b"], None),
    ]
    skip, only = set(args.skip.split(",")), set(filter(None, args.only.split(",")))
    plan = [p for p in plan if p[0] not in skip and (p[0] in only if only else p[0] not in FP8W)]
    results: list[dict] = [
        {"name": "meta", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
    ]
    for i, (name, cmd, nominal) in enumerate(plan):
        keep = sum(p[2] or 0.0 for p in plan[i + 1 :])
        left = t_end - time.perf_counter() - keep
        cap = left if nominal is None else min(nominal, left)
        if cap < 10:
            results.append({"name": f"{name}_exit", "rc": "skipped: out of time"})
            continue
        if name in ("fulcrum", "fp8", "hf", *FP8W):
            cmd = [*cmd, "--cap", str(cap - 8)]
        results += run_phase(name, cmd, cap, args.out, {"T_SPAWN": repr(time.time())})
        with open(os.path.join(args.out, "bench.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print("== summary")
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
