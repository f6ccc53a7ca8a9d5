"""Kernel tests run on the CPU through Triton's interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, hence this conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _fix_interpreter_index() -> None:
    """Let loop bounds computed in a kernel work in the interpreter under NumPy >= 2.4.

    The interpreter stores scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects (triton-lang/triton#9171); ``for n in range(start, end, BLOCK)``
    with runtime ``start``/``end`` then fails. This applies the upstream fix.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_fulcrum_fixed", False):
        return

    def patched(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patched._fulcrum_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
