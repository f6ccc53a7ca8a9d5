"""fulcrum: an LLM inference and serving engine."""

from fulcrum.sampling_params import SamplingParams

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
