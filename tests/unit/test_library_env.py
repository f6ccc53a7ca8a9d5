"""Other libraries' variables fulcrum gives a default: oneDNN's and ideep's per-shape caches on
the CPU are capped before a CPU engine's first oneDNN primitive, and a value a user set stays."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fulcrum.envs import LIBRARY_DEFAULTS

_PROBE = """
import json, os, sys
from fulcrum import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory=0.01)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
print(json.dumps({k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}))
"""


def _probe(model: str, **env: str) -> dict[str, str | None]:
    base = {k: v for k, v in os.environ.items() if k not in LIBRARY_DEFAULTS}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    base["PYTHONPATH"] = os.pathsep.join([src, base.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, model], env=base | env, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_engine_caps_the_per_shape_caches_and_keeps_a_users_value(tiny_models) -> None:
    assert _probe(tiny_models["llama"]) == LIBRARY_DEFAULTS
    got = _probe(tiny_models["llama"], LRU_CACHE_CAPACITY="7")
    assert got == LIBRARY_DEFAULTS | {"LRU_CACHE_CAPACITY": "7"}
