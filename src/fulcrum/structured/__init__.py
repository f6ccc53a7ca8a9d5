"""Structured output: grammar backends behind one ABC, compiled off the engine loop (manager.py),
request validation before queuing (validate.py), and the bitmask applied to the logits (apply.py)."""
