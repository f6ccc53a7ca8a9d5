"""Frozen configuration dataclasses shared by every subsystem."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: unknown device {device!r} ({e}).") from None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (exact against the reference) and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype: unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}."
        )
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """What to run: the resolved architecture config plus where its weights and tokenizer live."""

    model: str  # path given by the user (dir, .gguf file, or configs/ name for dummy)
    hf_config: Any  # transformers.PretrainedConfig
    weights_path: str  # directory holding *.safetensors (or the .gguf file)
    tokenizer_path: str | None  # directory loadable by AutoTokenizer (None: no tokenizer)
    load_format: str  # "safetensors" | "gguf" | "dummy"
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    quantization: str | None = None  # weight format of the decoder's projections (quant/)

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    Its size is ``num_blocks`` if given, else ``kv_cache_memory`` GiB (CPU), else the free GPU
    memory under ``gpu_memory_utilization`` after a profiling forward pass (CUDA).
    """

    block_size: int = 16
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (see kv_cache.dtype)

    def __post_init__(self) -> None:
        from fulcrum.kv_cache.dtype import KV_CACHE_DTYPES

        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.cache_dtype!r}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive GiB, got {self.kv_cache_memory}.")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}.")


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes, prefill chunks and speculative tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    schedule_policy: str = "fcfs"  # "fcfs" | "lpm"
    # LPM degrades to FCFS beyond this many waiting requests (sorting cost, starvation).
    lpm_max_queue: int = 128

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}."
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    attention_backend: str = "auto"  # "torch" | "triton" | "auto"
    enforce_eager: bool = True
    async_scheduling: bool = False  # schedule step N+1 before step N's tokens are back
    piecewise_graph_max_tokens: int = 0  # prefill/mixed steps up to this many tokens: graphs
    extra: dict[str, Any] = field(default_factory=dict)
