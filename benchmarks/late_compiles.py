"""Which Triton kernel variants compile only after the engine is ready, i.e. at a user's request?

Every variant a process compiles (or loads from Triton's disk cache) is recorded through
``triton.knobs.runtime.jit_cache_hook`` with its specialisation (argument divisibility, values
specialised to constants); then the engine serves a few workload shapes and the variants each
first needed are printed with the wall time the workload took. Run it with an empty
``TRITON_CACHE_DIR`` to see the compile time too.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/late_compiles.py
    (Llama-3.1-8B shape, dummy weights, bf16, the engine settings of gpu_h200.py)
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_h200 as g  # noqa: E402

events: list[str] = []


def _hook(**kw) -> bool:
    try:
        names = kw["fn"].jit_function.arg_names
        c = kw["compile"]
        attrs = {names[k[0]]: v for k, v in c["configs"][0].items() if v}
        consts = {names[k[0]]: v for k, v in c["constants"].items()}
        events.append(f"{kw['fn'].name} specialised={attrs} constants={consts}")
    except (KeyError, IndexError, AttributeError) as e:  # another Triton's hook arguments
        events.append(f"{kw.get('repr', '?')[:200]} ({e!r})")
    return False  # compile as usual


def main() -> None:
    from triton import knobs

    knobs.runtime.jit_cache_hook = _hook
    from fulcrum import LLM

    t0 = time.perf_counter()
    llm = LLM(g.MODEL, **g.ENGINE)
    print(f"engine ready in {time.perf_counter() - t0:.2f} s, {len(events)} variants", flush=True)
    drv = g.Driver(llm)
    plan = [
        ("one 128-token prompt", g.workload(1, 128, 4, 1)),
        ("one 1000-token prompt", g.workload(1, 1000, 4, 5)),
        ("300 x 128/16", g.workload(300, 128, 16, 2)),
        ("64 x 1000/16", g.workload(64, 1000, 16, 3)),
        ("400 x 128/128", g.workload(400, 128, 128, 4)),
    ]
    for name, reqs in plan:
        n0, t = len(events), time.perf_counter()
        drv.run(reqs, t + 300)
        print(f"{name}: {time.perf_counter() - t:.2f} s, {len(events) - n0} new variants")
        for e in events[n0:]:
            print("   ", e, flush=True)


if __name__ == "__main__":
    main()
