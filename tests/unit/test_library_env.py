"""oneDNN's and ideep's per-shape caches are sized by ``kernel_config.cpu_primitive_cache`` before
a CPU engine's first oneDNN primitive, unless the environment sizes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fulcrum.envs import PRIMITIVE_CACHE_VARIABLES

_PROBE = """
import json, os, sys
from fulcrum import LLM, SamplingParams
kc = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory=0.01, kernel_config=kc)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
print(json.dumps({k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}))
"""


def _probe(model: str, kernel_config: dict, **env: str) -> dict[str, str | None]:
    base = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_VARIABLES}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    base["PYTHONPATH"] = os.pathsep.join([src, base.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, model, json.dumps(kernel_config)], env=base | env, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_engine_sizes_the_per_shape_caches_and_keeps_the_environments(tiny_models) -> None:
    model = tiny_models["llama"]
    both = dict.fromkeys(PRIMITIVE_CACHE_VARIABLES, "64")
    assert _probe(model, {}) == both
    assert _probe(model, {"cpu_primitive_cache": 5}, LRU_CACHE_CAPACITY="7") == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "5",
        "LRU_CACHE_CAPACITY": "7",
    }
