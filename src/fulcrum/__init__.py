"""fulcrum: an LLM inference and serving engine."""

import os

# Huge pages for torch's large CPU allocations (the KV pool, each step's gathered K/V): with 4 KiB
# pages a CPU decode step spent much of its time faulting in fresh memory, and run times of one
# workload varied 2x (SmolLM2, 32 x 1,064-token prompts: 19.9-47.4 s without, 19.8-27.4 s with).
# torch reads this once, at its first allocation, so it only takes effect before torch is used.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from fulcrum.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from fulcrum.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from fulcrum.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
