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

# -- other libraries' variables a CPU engine sets where unset (KernelConfig.cpu_primitive_cache) ---
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def seed_primitive_caches(entries: int) -> None:
    """Give oneDNN's and ideep's per-shape caches ``entries`` where the environment does not
    size them; effective before the process's first oneDNN primitive (read once)."""
    for name in PRIMITIVE_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
