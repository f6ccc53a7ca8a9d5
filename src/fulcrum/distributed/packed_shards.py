"""GPTQ and AWQ checkpoints over tensor-parallel ranks: the part of each packed tensor a rank
reads (lazily, as ``sharding.py`` reads float weights), and the start-up check that every rank's
slice falls on a word and a group boundary. Layouts as in ``quant/int_format.py``::

    tensor          column-parallel (qkv, gate_up)      row-parallel (o_proj, down_proj)
                    its output features [s, s + n)      its input features [s, s + n)
    GPTQ qweight    [in/P, out]: columns s .. s+n       rows s/P .. (s+n)/P
         qzeros     [groups, out/P]: columns /P         its groups' rows *
         scales     [groups, out]: columns              its groups' rows *
         g_idx      [in]: whole                         [s, s + n), less s / group *
    AWQ  qweight    [in, out/8]: columns /8             rows s .. s+n
         qzeros     [groups, out/8]: columns /8         its groups' rows
         scales     [groups, out]: columns              its groups' rows

    * group_size -1 (one group per row): the one row of zeros and scales on every rank, which
      is exact: each slice of a row keeps the row's scale. Act-order (GPTQ ``desc_act``): every
      group's row, and g_idx as stored, since a group's rows are spread over all the slices; the
      layer regroups the rows it holds (``quant/int_regroup.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fulcrum.quant.int_format import IntWeightFormat

LEAVES = ("qweight", "qzeros", "scales", "g_idx")
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}


def whole(src: Any) -> torch.Tensor:
    """All of ``src`` (a tensor, or a safetensors slice read in full)."""
    return src if isinstance(src, torch.Tensor) else src[:]


def _ranges(spec: Any) -> dict[str, tuple[int, int]]:
    return {"q": spec.q_range(), "kv": spec.kv_range(), "mlp": spec.mlp_range()}


def _fused_parts(spec: Any, proj: str) -> list[tuple[int, int, int]]:
    """``(checkpoint offset, start, size)`` of a fused projection's parts on this rank."""
    r = _ranges(spec)
    if proj == "qkv_proj":
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [(0, *r["q"]), (q, *r["kv"]), (q + kv, *r["kv"])]
    i = spec.intermediate_size
    return [(0, *r["mlp"]), (i, *r["mlp"])]


def packed_slice(spec: Any, fmt: IntWeightFormat, name: str, src: Any) -> torch.Tensor | None:
    """This rank's part of packed checkpoint tensor ``name`` (``src``: a tensor or a
    safetensors slice); None for a tensor that is not one of a projection's packed leaves."""
    owner, _, leaf = name.rpartition(".")
    proj = owner.rpartition(".")[2]
    if leaf not in LEAVES:
        return None
    if proj in _ROW:
        return _row_slice(fmt, leaf, src, *_ranges(spec)[_ROW[proj]])
    if leaf == "g_idx":  # column-parallel: every input row
        return whole(src)
    div = fmt.out_divisor(leaf)
    if proj in _COLUMN:
        parts = [(0, *_ranges(spec)[_COLUMN[proj]])]
    elif proj in ("qkv_proj", "gate_up_proj"):  # already fused in the checkpoint (Phi-3)
        parts = _fused_parts(spec, proj)
    else:
        return None
    cols = [src[:, (o + s) // div : (o + s + n) // div] for o, s, n in parts]
    return torch.cat(cols, 1).contiguous() if len(cols) > 1 else cols[0].contiguous()


def _row_slice(fmt: IntWeightFormat, leaf: str, src: Any, start: int, n: int) -> torch.Tensor:
    group = fmt.group_size
    if leaf == "qweight":
        p = fmt.pack if fmt.method == "gptq" else 1
        return src[start // p : (start + n) // p].contiguous()
    every_group = group == -1 or fmt.desc_act
    if leaf == "g_idx":
        g_idx = src[start : start + n]
        return g_idx if every_group else g_idx - start // group
    if every_group:
        return whole(src)
    return src[start // group : (start + n) // group].contiguous()


def check_packed_shards(spec: Any, fmt: IntWeightFormat, where: str) -> None:
    """Raise ``ValueError`` naming the layer and the numbers where a rank's slice of a packed
    projection would split a word or (row-parallel, not act-order) a quantization group."""
    r = _ranges(spec)
    full = {"q": spec.num_heads * spec.head_dim, "mlp": spec.intermediate_size}
    for proj, part in _COLUMN.items():
        n = r[part][1]
        if n % fmt.pack:
            raise ValueError(
                f"{where}: {_layer(proj)} splits into {n} output features per rank, not a "
                f"multiple of the {fmt.pack} that {fmt.method} packs in one word (qzeros)."
            )
    for proj, part in _ROW.items():
        n = r[part][1]
        need = [(fmt.pack, f"the {fmt.pack} that {fmt.method} packs in one word")]
        if fmt.group_size != -1 and not fmt.desc_act:
            need.append((fmt.group_size, f"quantization_config.group_size {fmt.group_size} (a "
                         "rank's slice must hold whole groups)"))  # fmt: skip
        for div, what in need:
            if n % div:
                raise ValueError(
                    f"{where}: {_layer(proj)}'s {full[part]} input features split into {n} per "
                    f"rank, not a multiple of {what}."
                )


def _layer(proj: str) -> str:
    parent = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.*.{parent}.{proj}"
