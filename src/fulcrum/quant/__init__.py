"""Quantization methods behind one ABC (``base.QuantMethod``), looked up by name."""

from typing import Any

from fulcrum.quant.base import QUANT_METHODS, QuantMethod

__all__ = ["QUANT_METHODS", "QuantMethod", "get_quant_method"]


def get_quant_method(
    name: str | None, quant_config: dict[str, Any] | None = None
) -> QuantMethod | None:
    """The method called ``name`` (``None`` or ``"none"``: full precision, no method), for a
    checkpoint with ``quant_config`` (its ``config.json``'s ``quantization_config``)."""
    if name in (None, "none"):
        return None
    import fulcrum.quant.fp8  # noqa: F401  (registers)
    import fulcrum.quant.gguf  # noqa: F401  (registers)
    import fulcrum.quant.int4  # noqa: F401  (registers)

    if name not in QUANT_METHODS:
        raise ValueError(
            f"quantization: unknown method {name!r}; expected none or one of "
            f"{', '.join(sorted(QUANT_METHODS))}."
        )
    return QUANT_METHODS[name].from_quant_config(quant_config)
