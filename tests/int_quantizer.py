"""A small GPTQ/AWQ checkpoint writer and a reference dequantizer for the tests, both written
from the formats' descriptions (AutoGPTQ's and AutoAWQ's packing), not from fulcrum's loader.

Round-to-nearest per group (optionally over a random act-order permutation of the input
channels); the quantization's accuracy does not matter here, only that each on-disk layout is
the real one. ``write_quantized`` also saves the model with the dequantized weights, which
transformers then runs as the reference.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column ORDER[j] of its 8
_PROJ = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None):
    """Pack ``32 / bits`` consecutive values along ``dim`` into one int32, value j (or
    ``order[j]``) at bits ``j * bits``."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(per):
        words |= v[..., order[j] if order else j] << (j * bits)
    return _to_int32(words).movedim(-1, dim).contiguous()


def quantize_linear(
    w: torch.Tensor, method: str, bits: int, group_size: int, sym: bool, desc_act: bool,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """``w [out, in]`` -> the layer's checkpoint tensors in ``method``'s layout. Act-order's
    permutation is drawn from ``gen``: projections of one input (q/k/v, gate/up) share it in
    real checkpoints (the same Hessian), so pass them generators in the same state."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    wp = w[:, perm].float()  # position i quantizes input channel perm[i]
    wg = wp.reshape(n, k // gs, gs)
    if sym:
        half = 1 << (bits - 1)
        scale = wg.abs().amax(-1) / (half - 1)
        zero = torch.full_like(scale, half)
    else:  # GPTQ v1 cannot store a zero of 0 (it writes zero - 1): keep zeros >= 1 there
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / scale.clamp(min=1e-8)).clamp(1 if method == "gptq" else 0, maxq)
    scale = scale.clamp(min=1e-6).half()
    q = (torch.round(wg / scale.float()[..., None]) + zero[..., None]).clamp(0, maxq)
    q = q.reshape(n, k).to(torch.int64)
    q_orig = torch.empty_like(q)
    q_orig[:, perm] = q  # back to the checkpoint's channel order
    scales = scale.t().contiguous()  # [groups, out]
    zeros = zero.t().to(torch.int64)  # [groups, out]
    if method == "awq":
        assert bits == 4 and not desc_act
        return {
            "qweight": _pack(q_orig.t(), 4, 1, AWQ_ORDER),
            "qzeros": _pack(zeros, 4, 1, AWQ_ORDER),
            "scales": scales,
        }
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    return {
        "qweight": _pack(q_orig.t(), bits, 0),
        "qzeros": _pack(zeros - 1, bits, 1),  # the v1 format: zero minus one
        "scales": scales,
        "g_idx": g_idx,
    }


def dequantize_reference(t: dict[str, torch.Tensor], method: str, bits: int, group_size: int):
    """The layer's ``[out, in]`` fp32 weight, value by value from the format's description."""
    maxq = (1 << bits) - 1
    scales = t["scales"].float()
    qw = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    qz = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    out = scales.shape[1]
    cols = torch.arange(out)
    if method == "awq":
        k = qw.shape[0]
        gs = k if group_size == -1 else group_size
        shift = torch.tensor([AWQ_ORDER.index(c % 8) * 4 for c in range(out)])
        q = (qw[:, cols // 8] >> shift) & maxq  # [in, out]
        g = torch.arange(k) // gs
        z = (qz[g][:, cols // 8] >> shift) & maxq
    else:
        per = 32 // bits
        k = qw.shape[0] * per
        rows = torch.arange(k)
        q = (qw[rows // per] >> ((rows % per) * bits)[:, None]) & maxq
        g = t["g_idx"].long()
        z = ((qz[g][:, cols // per] >> ((cols % per) * bits)) & maxq) + 1
    return ((q - z).float() * scales[g]).t().contiguous()


def write_quantized(
    src: str, dst: str, ref: str, method: str, bits: int = 4, group_size: int = 32,
    sym: bool = True, desc_act: bool = False, seed: int = 0,
) -> None:  # fmt: skip
    """Quantize the model in ``src`` into a ``method`` checkpoint at ``dst``, and save the
    model with the reference-dequantized weights at ``ref``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    dequant: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not _PROJ.search(name):
            tensors[name] = w.clone().contiguous()
            continue
        prefix = name.removesuffix(".weight")
        layer = int(name.split(".layers.")[1].split(".")[0])
        kind = _PROJ.search(name).group(1)
        shared_input = {"k": "q", "v": "q", "up": "gate"}.get(kind, kind)
        gen = torch.Generator().manual_seed(hash((seed, layer, shared_input)) % 2**31)
        t = quantize_linear(w, method, bits, group_size, sym, desc_act, gen)
        tensors.update({f"{prefix}.{key}": v for key, v in t.items()})
        dequant[name] = dequantize_reference(t, method, bits, group_size)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm"}  # fmt: skip
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": "gptq"}  # fmt: skip
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    for extra in ("generation_config.json",):
        if os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)
    model.load_state_dict({**state, **dequant})
    model.save_pretrained(ref, safe_serialization=True)


def checkpoint_maker(sources: dict[str, str], root, formats: dict[str, tuple], seed: int):
    """``get(arch, fmt) -> (checkpoint dir, reference dir)`` for the model ``sources[arch]``
    quantized as ``formats[fmt] = (method, bits, group_size, sym, desc_act)``, written under
    ``root`` on first use."""
    made: dict[tuple[str, str], tuple[str, str]] = {}

    def get(arch: str, fmt: str) -> tuple[str, str]:
        if (arch, fmt) not in made:
            method, bits, gs, sym, act = formats[fmt]
            dst, ref = os.path.join(root, f"{arch}_{fmt}"), os.path.join(root, f"{arch}_{fmt}_ref")
            write_quantized(sources[arch], dst, ref, method, bits, gs, sym, act, seed=seed)
            made[arch, fmt] = (dst, ref)
        return made[arch, fmt]

    return get


def with_config(src: str, dst: str, quant: dict | None = None, **model) -> str:
    """A copy of checkpoint ``src`` at ``dst`` (its files linked) whose config.json has
    ``quant`` merged into its ``quantization_config`` and ``model`` into its top level."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    config["quantization_config"].update(quant or {})
    config.update(model)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return dst
