"""Weight quantization methods (``base.QuantMethod`` and its registry)."""

from fulcrum.quant.base import QUANT_METHODS, QuantMethod, get_quant_method

__all__ = ["QUANT_METHODS", "QuantMethod", "get_quant_method"]
