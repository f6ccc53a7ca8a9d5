"""Which attention backend serves a device: the registry's lookup, with ``auto`` resolved.

Apart from ``backend.py`` because it imports the backends, and they import the ABC and the
registry from there.
"""

from __future__ import annotations

import torch

from fulcrum.attention.backend import ATTENTION_BACKENDS, AttentionBackend


def get_backend_cls(name: str, device: torch.device) -> type[AttentionBackend]:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        from fulcrum.attention import torch_ref  # noqa: F401
    elif name == "triton":
        from fulcrum.attention import triton_backend  # noqa: F401
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; choose auto, torch, triton."
        )
    return ATTENTION_BACKENDS[name]


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    import importlib.util

    return importlib.util.find_spec("fulcrum.attention.triton_backend") is not None
