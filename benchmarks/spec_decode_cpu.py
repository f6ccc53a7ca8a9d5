"""Speculative decoding on the CPU with the embedded SmolLM2-135M, one request at a time.

Two prompt sets: copy-heavy tasks (rewrite code with one change, summarize quoting the text,
fill a JSON template, continue a numbered list) where the answer repeats the prompt, and
open-ended chat prompts where it does not. For each method (none, ngram, suffix): output
tokens/s (generation wall time over output tokens; also over this process's CPU time, steadier
on a machine other jobs load), mean acceptance length (tokens a verify step emits: 1 + accepted
/ verify steps), and whether the greedy text equals the run without speculation. One engine per
method; each prompt runs under every method in turn, ``--repeats`` times (medians reported).

    PYTHONPATH=src python benchmarks/spec_decode_cpu.py [--max-tokens 128] [--k 4]
        [--methods none ngram suffix] [--sets copy open] [--prompts N] [--repeats R]
        [--json out.json] [--device cuda --dtype bfloat16]

On a GPU (``--device cuda``) the same runs measure real acceptance with the real model at the
GPU's step cost; greedy text may then differ from the run without speculation where bf16
verify rows round differently from decode rows.

Prints one ``RESULT {json}`` line per (set, method).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# Each copy-heavy prompt is the task as a user would pose it, in a form SmolLM2-135M-Instruct
# carries out under greedy decoding, if imperfectly: it reproduces the fenced code with the
# change attempted, summarizes in the passage's own sentences, fills the template's keys and
# continues the list. (An unfenced code block it did not reproduce, and a passage it
# paraphrased, measured the model failing the task rather than copying.)
CODE = """import csv


def read_scores(path):
    scores = {}
    with open(path) as f:
        reader = csv.reader(f)
        for name, score in reader:
            scores[name] = int(score)
    return scores


def average(scores):
    return sum(scores.values()) / len(scores)


def best(scores):
    return max(scores, key=scores.get)


if __name__ == "__main__":
    scores = read_scores("scores.csv")
    print("average:", average(scores))
    print("best:", best(scores))
"""

TEXT = (
    "Honeybees live in colonies of up to 60,000 workers. A worker bee lives for about six weeks "
    "in summer. During that time she cleans cells, feeds larvae, builds wax comb and guards the "
    "entrance before she finally leaves the hive to collect nectar. A single bee makes about one "
    "twelfth of a teaspoon of honey in her whole life. To make one pound of honey, the bees of a "
    "hive must visit about two million flowers."
)

COPY = [
    "Here is my Python code:\n\n```python\n" + CODE + "```\n\nRewrite the code with one "
    "change: the function average should return 0 when scores is empty. Output the complete "
    "code.",
    "Summarize this passage for a school report. Use direct quotes from the passage, in "
    "quotation marks, for the key facts.\n\nPassage:\n" + TEXT,
    "Fill in this JSON template for a user named Alice Smith, aged 34, living in Paris, "
    'email alice@example.com. Output only the JSON.\n\n{"user": {"first_name": "", '
    '"last_name": "", "age": 0, "address": {"city": "", "country": ""}, "email": ""}}',
    "Continue this numbered list to item 12, in the same format:\n1. Step 1: open the file.\n"
    "2. Step 2: read the file.\n3. Step 3: close the file.\n4. Step 4: open the file.\n"
    "5. Step 5: read the file.\n",
]

OPEN = [
    "What are three good habits for staying healthy?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a child.",
]

SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
}


def make_llm(method: str, k: int, device: str, dtype: str, share: float = 0.9):
    from fulcrum import LLM, SamplingParams

    spec = SPECS[method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": k}
    # One engine per method lives in this process: on a GPU each takes its share of memory
    # (``gpu_memory_utilization`` counts the whole device's use).
    mem = {"gpu_memory_utilization": share} if device != "cpu" else {}
    llm = LLM(dtype=dtype, device=device, speculative_config=spec, **mem)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def fresh_proposer(llm) -> None:
    """Every repeat starts as a new engine would: no suffix trie of earlier outputs, zero
    counters (a repeat would otherwise find its own earlier answers in the global trie)."""
    from fulcrum.spec_decode.registry import make_proposer
    from fulcrum.spec_decode.stats import SpecDecodeStats

    sched = llm.core.scheduler
    if sched.spec_config is not None:
        sched.proposer = make_proposer(sched.spec_config)
        sched.spec_stats = SpecDecodeStats(sched.spec_config.num_speculative_tokens)


def run_prompt(llm, prompt: str, max_tokens: int) -> tuple[str, int, float, float]:
    """One request at a time: (text, output tokens, wall s, CPU s of this process)."""
    from fulcrum import SamplingParams

    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    out = llm.generate([chat], sp, use_tqdm=False)[0].outputs[0]
    return out.text, len(out.token_ids), time.perf_counter() - t0, time.process_time() - c0


def run_set(llms: dict, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    """Each prompt runs under every method in turn (the order rotating per repeat), so load
    from other processes falls on all methods alike; per method the median over repeats."""
    methods = list(llms)
    walls: dict[str, list[float]] = {m: [] for m in methods}
    cpus: dict[str, list[float]] = {m: [] for m in methods}
    res: dict[str, dict] = {}
    for r in range(repeats):
        for llm in llms.values():
            fresh_proposer(llm)
        texts: dict[str, list[str]] = {m: [] for m in methods}
        n_out = dict.fromkeys(methods, 0)
        wall = dict.fromkeys(methods, 0.0)
        cpu = dict.fromkeys(methods, 0.0)
        for i, p in enumerate(prompts):
            rot = (r + i) % len(methods)
            for m in methods[rot:] + methods[:rot]:
                text, n, w, c = run_prompt(llms[m], p, max_tokens)
                texts[m].append(text)
                n_out[m] += n
                wall[m] += w
                cpu[m] += c
        for m in methods:
            walls[m].append(n_out[m] / wall[m])
            cpus[m].append(n_out[m] / cpu[m])
            st = llms[m].core.scheduler.spec_stats
            res[m] = {
                "output_tokens": n_out[m],
                "mean_acceptance_length": st.mean_acceptance_length if st.num_drafts else None,
                "num_drafts": st.num_drafts,
                "draft_tokens": st.num_draft_tokens,
                "accepted_tokens": st.num_accepted_tokens,
                "texts": texts[m],
            }
    for m in methods:
        res[m]["tokens_per_s"] = statistics.median(walls[m])
        res[m]["tokens_per_cpu_s"] = statistics.median(cpus[m])
        res[m]["tokens_per_s_runs"] = [round(x, 2) for x in walls[m]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--methods", nargs="+", default=list(SPECS), choices=list(SPECS))
    ap.add_argument("--sets", nargs="+", default=["copy", "open"], choices=["copy", "open"])
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of each set")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each set; medians reported")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the same runs on a GPU")
    ap.add_argument("--dtype", default="float32", help="weights' and activations' dtype")
    args = ap.parse_args()
    n = len(args.methods)
    llms = {
        m: make_llm(m, args.k, args.device, args.dtype, 0.9 * (i + 1) / n)
        for i, m in enumerate(args.methods)
    }
    results = []
    for name in args.sets:
        prompts = (COPY if name == "copy" else OPEN)[: args.prompts]
        res = run_set(llms, prompts, args.max_tokens, args.repeats)
        base = res.get("none")
        for method, r in res.items():
            row = {
                "set": name, "method": method, "k": args.k,
                **{key: v for key, v in r.items() if key != "texts"},
                "speedup": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
                "cpu_speedup": r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"] if base else None,
                "identical_text": r["texts"] == base["texts"] if base else None,
            }
            print("RESULT " + json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
