"""Test-time fixes for Triton's CPU interpreter."""

from __future__ import annotations


def fix_interpreter_index() -> None:
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
