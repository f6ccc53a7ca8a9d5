"""Test helpers: a round-to-nearest K-quant encoder (``gguf`` only decodes Q4_K/Q5_K/Q6_K) and a
tiny random Llama written as a GGUF file whose projections use the types asked for, with the
embedded SmolLM2's tokenizer (cut to its first tokens) and chat template, so transformers and
fulcrum can read it."""

from __future__ import annotations

import functools

import numpy as np

VOCAB = 4096  # SmolLM2's first tokens (and the merges among them): a small, fast tokenizer
WSCALE = 3.0  # weights at 3 / sqrt(fan-in): greedy tokens vary (smaller ones repeat one token)
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pairs(lo: np.ndarray) -> np.ndarray:
    """``[B, C, 2, R]`` nibbles -> ``[B, C * R]`` bytes (the first in the low nibble)."""
    return (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(lo.shape[0], -1)


def quantize_k(w: np.ndarray, type_name: str) -> np.ndarray:
    """``float32 [n, k]`` -> ``uint8 [n, k / 256 * bytes]`` blocks of ``type_name``."""
    n, k = w.shape
    if type_name == "Q6_K":
        x = w.reshape(-1, 16, 16)
        scale = np.abs(x).max(-1) / 31 + 1e-12
        d = (scale.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
        eff = d.astype(np.float32)[:, None] * sc
        q = (np.clip(np.round(x / eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
        ql = _pairs((q & 15).reshape(-1, 2, 2, 64))
        hi = (q >> 4).reshape(-1, 2, 4, 32)
        qh = sum(hi[:, :, s, :] << (2 * s) for s in range(4)).reshape(-1, 64).astype(np.uint8)
        blocks = [ql, qh, sc.view(np.uint8), _f16_bytes(d)]
    else:
        qmax = 15 if type_name == "Q4_K" else 31
        x = w.reshape(-1, 8, 32)
        lo, hi_ = np.minimum(x.min(-1), 0), x.max(-1)
        scale, mval = (hi_ - lo) / qmax + 1e-12, -lo
        d = (scale.max(-1) / 63).astype(np.float16)
        dmin = (mval.max(-1) / 63 + 1e-12).astype(np.float16)
        sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
        mq = np.clip(np.round(mval / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
        s_eff = d.astype(np.float32)[:, None] * sc
        m_eff = dmin.astype(np.float32)[:, None] * mq
        q = np.clip(np.round((x + m_eff[..., None]) / s_eff[..., None]), 0, qmax).astype(np.uint8)
        scales = np.concatenate(
            [
                (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                (mq[:, :4] & 63) | ((mq[:, 4:] >> 4) << 6),
                (sc[:, 4:] & 15) | ((mq[:, 4:] & 15) << 4),
            ],
            axis=1,
        )
        qs = _pairs((q & 15).reshape(-1, 4, 2, 32))
        blocks = [_f16_bytes(d), _f16_bytes(dmin), scales]
        if type_name == "Q5_K":  # byte i, bit j: the fifth bit of value i of sub-block j
            blocks.append(sum(((q[:, j, :] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
        blocks.append(qs)
    return np.concatenate(blocks, axis=1).reshape(n, -1)


@functools.cache
def _metadata() -> list[tuple]:
    """SmolLM2's key-value fields (key, value, type, sub-type), the vocabulary cut to VOCAB."""
    import gguf

    from fulcrum.model.loader.default_model import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:VOCAB]
        out.append((key, value, field.types[0], sub))
    kept = set(next(v for k, v, *_ in out if k == "tokenizer.ggml.tokens"))
    for i, (key, value, vtype, sub) in enumerate(out):
        if key == "tokenizer.ggml.merges":  # only merges of kept tokens into a kept token
            merges = [m for m in value if (p := m.split(" "))[0] in kept and p[1] in kept
                      and p[0] + p[1] in kept]  # fmt: skip
            out[i] = (key, merges, vtype, sub)
    return out


def write_tiny_llama(
    path: str, types: dict[tuple[int, str], str], seed: int = 0, arch: str = "llama",
    untied: bool = False,
) -> None:
    """A 2-layer Llama (hidden 256, GQA 4/2 heads, VOCAB tokens) at ``path``; projection
    ``(layer, gguf name)`` (``attn_q``, ``ffn_down``, ...) has ``types[...]`` (default Q4_K).
    ``arch="qwen2"``: the same shapes as a Qwen2 file, with q/k/v biases; ``untied``: an
    ``output.weight`` (Q8_0) of its own instead of the embedding's."""
    import gguf

    over = {
        "block_count": LAYERS, "embedding_length": HIDDEN,
        "feed_forward_length": INTER, "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HIDDEN // HEADS,
        "context_length": 512, "vocab_size": VOCAB,
    }  # fmt: skip
    writer = gguf.GGUFWriter(path, arch)
    for key, value, vtype, sub in _metadata():
        if key.startswith("llama."):
            key = arch + key[len("llama") :]
            value = over.get(key[len(arch) + 1 :], value)
        writer.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    writer.add_tensor(
        "token_embd.weight", (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float16)
    )
    writer.add_tensor(
        "output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    )
    if untied:
        w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float32)
        writer.add_tensor("output.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    head = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN),
              "attn_v": (KV_HEADS * head, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}  # fmt: skip
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{norm}.weight", w)
        for name, (n, k) in shapes.items():
            w = (rng.standard_normal((n, k)) * WSCALE / np.sqrt(k)).astype(np.float32)
            w += rng.uniform(-0.05, 0.05, (n, 1)).astype(np.float32)  # rows off zero: mins matter
            t = types.get((i, name), "Q4_K")
            qtype = gguf.GGMLQuantizationType[t]
            blocks = quantize_k(w, t) if t.endswith("_K") else gguf.quants.quantize(w, qtype)
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=qtype)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                bias = (rng.standard_normal(n) * 0.5).astype(np.float32)
                writer.add_tensor(f"blk.{i}.{name}.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
