"""fulcrum: an LLM inference and serving engine."""

import os

# Huge pages for torch's large CPU allocations (the KV pool, each step's gathered K/V): with 4 KiB
# pages a CPU decode step spends much of its time faulting in fresh memory (BENCHMARKS.md, section
# 2: 7-15% faster, and no more runs twice as slow). torch reads this once, at its first
# allocation, so it only takes effect when set before torch is used.
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
