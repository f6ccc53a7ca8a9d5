"""Every environment variable fulcrum reads, declared once, typed, with its default.

The speed switches here only seed :class:`fulcrum.config.KernelConfig`'s defaults (for
debugging: turn a fast path off without editing code); the engine reads the config, never the
environment. A variable is read when a default is built, so a test or a launcher may set it
before it builds a config. Set a switch for real with ``EngineArgs(kernel_config=...)`` or
``--kernel-config``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvBool:
    """``1`` is on, ``0`` off; unset: ``default``."""

    name: str
    default: bool

    def get(self) -> bool:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if raw not in ("0", "1"):
            raise ValueError(f"{self.name}: expected 0 or 1, got {raw!r}.")
        return raw == "1"


@dataclass(frozen=True)
class EnvInt:
    name: str
    default: int

    def get(self) -> int:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{self.name}: expected an integer, got {raw!r}.") from None


@dataclass(frozen=True)
class EnvStr:
    name: str
    default: str | None

    def get(self) -> str | None:
        return os.environ.get(self.name) or self.default


# -- seeds of KernelConfig's defaults (see its fields for what each does) -------------------------
FULCRUM_DISABLE_TRITON_KERNELS = EnvBool("FULCRUM_DISABLE_TRITON_KERNELS", False)
FULCRUM_PDL = EnvBool("FULCRUM_PDL", True)
FULCRUM_PDL_PRE = EnvBool("FULCRUM_PDL_PRE", True)
FULCRUM_GEMV_MAX_M = EnvInt("FULCRUM_GEMV_MAX_M", 1)
FULCRUM_GEMV_SILU = EnvBool("FULCRUM_GEMV_SILU", True)
FULCRUM_GEMV_ROPE = EnvBool("FULCRUM_GEMV_ROPE", True)
# "bf16=4,2048,4;fp8=4,1024,4": (block_n, block_k, num_warps) per weight kind
FULCRUM_GEMV_CONFIG = EnvStr("FULCRUM_GEMV_CONFIG", "")
FULCRUM_ARGMAX_KERNEL = EnvBool("FULCRUM_ARGMAX_KERNEL", True)
FULCRUM_FUSED_SAMPLER = EnvBool("FULCRUM_FUSED_SAMPLER", True)
FULCRUM_GRAPH_PATCH = EnvBool("FULCRUM_GRAPH_PATCH", True)
FULCRUM_SAMPLE_IN_GRAPH = EnvBool("FULCRUM_SAMPLE_IN_GRAPH", True)
FULCRUM_CAPTURE_WARMUP = EnvBool("FULCRUM_CAPTURE_WARMUP", False)
FULCRUM_COMPILE_AHEAD = EnvBool("FULCRUM_COMPILE_AHEAD", True)
FULCRUM_FUSED_MOE = EnvBool("FULCRUM_FUSED_MOE", True)

# -- paths and process settings -------------------------------------------------------------------
FULCRUM_CACHE_DIR = EnvStr("FULCRUM_CACHE_DIR", None)  # converted GGUF models (~/.cache/fulcrum)
FULCRUM_CONFIGS_DIR = EnvStr("FULCRUM_CONFIGS_DIR", None)  # dummy-weight configs (repo configs/)
FULCRUM_LOG_LEVEL = EnvStr("FULCRUM_LOG_LEVEL", "INFO")  # the CLI's logging level
# debugging: write each server process's step timeline to <prefix>.core.jsonl / .api.jsonl
FULCRUM_STEP_TRACE = EnvStr("FULCRUM_STEP_TRACE", None)
FULCRUM_API_KEY = EnvStr("FULCRUM_API_KEY", None)  # the server's key when --api-key is not given

# -- other libraries' variables, given a default here (a value already set is kept) --------------
# oneDNN's primitive cache and PyTorch's ideep cache on the CPU keep one entry per input shape,
# 1,024 each by default. A serving CPU engine sees a new row count at almost every mixed step, so
# at their defaults its memory keeps growing over thousands of requests, which reads as a leak
# (BENCHMARKS §12); 64 entries hold the decode batch sizes in use, and re-creating an evicted
# primitive is cheap beside a step.
LIBRARY_DEFAULTS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def seed_library_defaults() -> None:
    """Set :data:`LIBRARY_DEFAULTS` where unset; effective before the process's first oneDNN
    primitive (the libraries read them once)."""
    for name, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(name, value)
