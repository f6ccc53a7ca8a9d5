"""Speculative decoding on the CPU with the embedded SmolLM2-135M, one request at a time.

Two prompt sets: copy-heavy tasks (rewrite code with one change, summarize quoting the text,
fill a JSON template, continue a numbered list) where the answer repeats the prompt, and
open-ended chat prompts where it does not. For each method (none, ngram, suffix): output
tokens/s (generation wall time over output tokens), mean acceptance length (tokens a verify step
emits: 1 + accepted / verify steps), and whether the greedy text equals the run without
speculation.

    PYTHONPATH=src python benchmarks/spec_decode_cpu.py [--max-tokens 128] [--k 4]
        [--methods none ngram suffix] [--sets copy open] [--prompts N] [--json out.json]

Prints one ``RESULT {json}`` line per (set, method).
"""

from __future__ import annotations

import argparse
import json
import time

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age = line.strip().split(",")
            users.append({"name": name, "age": int(age)})
    return users


def oldest(users):
    return max(users, key=lambda u: u["age"])
'''

TEXT = (
    "The lighthouse at Point Reyes was built in 1870. Its first-order Fresnel lens, made in "
    "France, has 1,032 pieces of glass and could be seen 24 nautical miles out to sea. The "
    "keepers climbed 308 steps each night to wind the clockwork that turned the lens. Fog is "
    "so common here that the station also had a steam-powered foghorn."
)

COPY = [
    "Rewrite this Python code, renaming the function load_users to read_users. Output only "
    "the full code.\n\n" + CODE,
    "Summarize this passage in three sentences, quoting its exact words wherever you can:\n\n"
    + TEXT,
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


def run_set(prompts: list[str], method: str, k: int, max_tokens: int) -> dict:
    from fulcrum import LLM, SamplingParams

    spec = SPECS[method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": k}
    llm = LLM(dtype="float32", device="cpu", speculative_config=spec)
    tok = llm.get_tokenizer()
    chat = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts, n_out, wall = [], 0, 0.0
    for p in chat:  # concurrency 1
        t0 = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        wall += time.perf_counter() - t0
        texts.append(out.text)
        n_out += len(out.token_ids)
    st = llm.core.scheduler.spec_stats
    return {
        "tokens_per_s": n_out / wall,
        "output_tokens": n_out,
        "wall_s": wall,
        "mean_acceptance_length": st.mean_acceptance_length if st.num_drafts else None,
        "num_drafts": st.num_drafts,
        "draft_tokens": st.num_draft_tokens,
        "accepted_tokens": st.num_accepted_tokens,
        "texts": texts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--methods", nargs="+", default=list(SPECS), choices=list(SPECS))
    ap.add_argument("--sets", nargs="+", default=["copy", "open"], choices=["copy", "open"])
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of each set")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    results = []
    for name in args.sets:
        prompts = (COPY if name == "copy" else OPEN)[: args.prompts]
        base = None
        for method in args.methods:
            r = run_set(prompts, method, args.k, args.max_tokens)
            if method == "none":
                base = r
            row = {
                "set": name, "method": method, "k": args.k,
                **{key: v for key, v in r.items() if key != "texts"},
                "speedup": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
                "identical_text": r["texts"] == base["texts"] if base else None,
            }
            print("RESULT " + json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
