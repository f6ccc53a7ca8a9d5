"""``fulcrum router``: an OpenAI-compatible front that spreads requests over many workers.

A top-level tool like ``bench`` and ``analyze``: it talks to workers only over HTTP, so it runs in
front of fulcrum, vLLM, SGLang or any other OpenAI-compatible server."""
