"""Benchmarks: ``fulcrum bench serve`` (online load), ``offline`` (in-process) and
``cold-start`` (server launch to first answer)."""
