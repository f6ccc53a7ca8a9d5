"""Triton kernels (each module imports triton; this package itself does not)."""

GEMV_MAX_M = 4  # most rows of x the batch-1 GEMV takes (kernels/gemv.py)
