"""Which layers attend through a sliding window, read once from a Hugging Face config.

A query at position p of a sliding layer sees keys p - window < j <= p (transformers' mask). The
same reading serves the model (each layer's attention window) and the KV cache (which blocks no
layer will read again):

    Mistral, Phi-3, Mixtral   ``sliding_window`` on every layer
    Qwen2/3 (+ MoE)           ``layer_types``, else as transformers derives them from
                              ``use_sliding_window`` / ``max_window_layers``
    Gemma 2/3                 ``layer_types``, or every ``sliding_window_pattern``-th layer global

A window of at least ``max_model_len`` tokens hides nothing from any position a sequence can
reach, so that layer is full attention here: no mask to apply, no blocks to free.
"""

from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"


def rope_layers(c) -> list[bool]:
    """Whether each layer applies rotary: all but SmolLM3's NoPE layers (``no_rope_layers``, 0
    for none; derived as transformers does, every ``no_rope_layer_interval``-th layer, where a
    hand-written config leaves the list out)."""
    n = c.num_hidden_layers
    flags = getattr(c, "no_rope_layers", None)
    arch = (getattr(c, "architectures", None) or [""])[0]
    if flags is None and arch.startswith("SmolLM3"):
        every = getattr(c, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if flags is None:
        return [True] * n
    if len(flags) != n:
        raise ValueError(f"no_rope_layers: expected {n} entries (one per layer), got {len(flags)}.")
    return [bool(f) for f in flags]


def layer_types(c) -> list[str]:
    """Each layer's attention type (``SLIDING`` or ``FULL``) as transformers runs the config."""
    n = c.num_hidden_layers
    arch = (getattr(c, "architectures", None) or [""])[0]
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types is None and arch.startswith(("Gemma2", "Gemma3")):  # configs written before
        every = getattr(c, "sliding_window_pattern", 6) if arch.startswith("Gemma3") else 2
        types = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
    elif types is None:  # transformers' defaults for configs that do not list them
        on = bool(getattr(c, "use_sliding_window", True) and window)  # the Qwen switch
        last = getattr(c, "max_window_layers", 28)
        if arch.startswith("Qwen2Moe"):
            sliding = [on and i % 2 == 0 and i < last for i in range(n)]
        elif arch.startswith("SmolLM3"):  # the window only where rotary is left out
            sliding = [on and not r for r in rope_layers(c)]
        elif arch.startswith(("Qwen2", "Qwen3")) and not arch.startswith("Qwen3Moe"):
            sliding = [on and i >= last for i in range(n)]
        else:  # Mistral, Phi-3, Mixtral, Qwen3-MoE: every layer
            sliding = [on] * n
        types = [SLIDING if s else FULL for s in sliding]
    types = list(types)
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types: expected {n} of {SLIDING!r} / {FULL!r}, got {types}.")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window: sliding layers need a positive window, got {window!r}.")
    return types


def layer_windows(c, max_model_len: int) -> list[int | None]:
    """Each layer's window in tokens, None for full attention (a window of ``max_model_len``
    tokens or more included)."""
    window = getattr(c, "sliding_window", None)
    return [window if t == SLIDING and window < max_model_len else None for t in layer_types(c)]


def kv_free_window(*models: list[int | None]) -> int | None:
    """The window outside which no layer of any model reading the cache (the target, a draft
    model sharing its block tables) sees a key, so KV blocks before it may be released: the
    widest window when every layer has one, else None (a global layer reads every key)."""
    windows = [w for m in models for w in m]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
