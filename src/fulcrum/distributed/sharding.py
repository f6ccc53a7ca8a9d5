"""Each rank's slice of each checkpoint tensor, read lazily (safetensors' ``get_slice`` reads
only those bytes). The layout is ``layers.py``'s: column-parallel projections split their
output rows, row-parallel ones their input columns, the vocabulary tables their rows; GPTQ and
AWQ's packed tensors as ``packed_shards.py`` says (GGUF's blocks: ``gguf_shards.py``, through
the rules here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fulcrum.distributed.layers import local_kv_heads, vocab_shard
from fulcrum.distributed.packed_shards import packed_slice, whole

if TYPE_CHECKING:
    from fulcrum.quant.int_format import IntWeightFormat

_PACKED = ("gptq", "awq")


@dataclass(frozen=True)
class ShardSpec:
    rank: int
    world: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    packed: IntWeightFormat | None = None  # a GPTQ/AWQ checkpoint's layout (packed_shards.py)

    @classmethod
    def from_hf(cls, c: Any, rank: int, world: int, quantization: str | None = None) -> ShardSpec:
        heads = c.num_attention_heads
        packed = None
        if quantization in _PACKED:  # (the format's module imports the W4A16 kernels')
            from fulcrum.quant.int_format import IntWeightFormat

            qc = getattr(c, "quantization_config", None)
            packed = IntWeightFormat.from_config(quantization, qc if isinstance(qc, dict) else None)
        return cls(
            rank, world, heads, getattr(c, "num_key_value_heads", None) or heads,
            getattr(c, "head_dim", None) or c.hidden_size // heads, c.intermediate_size,
            c.vocab_size, packed,
        )  # fmt: skip

    def q_range(self) -> tuple[int, int]:
        n = self.num_heads // self.world * self.head_dim
        return self.rank * n, n

    def kv_range(self) -> tuple[int, int]:
        kv, d = self.num_kv_heads, self.head_dim
        if kv >= self.world:
            n = local_kv_heads(kv, self.world)
            return self.rank * n * d, n * d
        return self.rank // (self.world // kv) * d, d  # replicated: ranks share a head

    def mlp_range(self) -> tuple[int, int]:
        n = self.intermediate_size // self.world
        return self.rank * n, n

    def rule(self, name: str) -> tuple[int, tuple[int, int]] | None:
        """``(dim, (start, length))`` of ``name``'s slice; None: every rank holds it whole."""
        if ".q_proj." in name:
            return 0, self.q_range()
        if ".k_proj." in name or ".v_proj." in name:
            return 0, self.kv_range()
        if ".gate_proj." in name or ".up_proj." in name:
            return 0, self.mlp_range()
        if name.endswith(".o_proj.weight"):
            return 1, self.q_range()
        if name.endswith(".down_proj.weight"):
            return 1, self.mlp_range()
        return None

    def __call__(self, name: str, src: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``; ``src`` is a tensor or a safetensors
        slice (both take ``[a:b]`` and ``[:, a:b]``)."""
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab_rows(src)
        if (
            self.packed is not None
            and (t := packed_slice(self, self.packed, name, src)) is not None
        ):
            return t
        if ".qkv_proj." in name or ".gate_up_proj." in name:  # already fused (Phi-3)
            return self._fused(name, whole(src))
        rule = self.rule(name)
        if rule is None:
            return whole(src)
        dim, (start, n) = rule
        return _take(src, dim, start, n)

    def _vocab_rows(self, src: Any) -> torch.Tensor:
        p = vocab_shard(self.vocab_size, self.world)
        start = min(self.rank * p, self.vocab_size)
        rows = _take(src, 0, start, min(p, self.vocab_size - start))
        if rows.shape[0] < p:  # the last shard's padding: zero rows (logits cut off after)
            rows = torch.cat([rows, rows.new_zeros(p - rows.shape[0], *rows.shape[1:])])
        return rows

    def _fused(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if ".qkv_proj." in name:
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            parts = t.split([q, kv, kv])
            ranges = [self.q_range(), self.kv_range(), self.kv_range()]
        else:
            parts = t.split(self.intermediate_size)
            ranges = [self.mlp_range()] * 2
        return torch.cat([p.narrow(0, s, n) for p, (s, n) in zip(parts, ranges, strict=True)])


def _take(src: Any, dim: int, start: int, n: int) -> torch.Tensor:
    t = src[start : start + n] if dim == 0 else src[:, start : start + n]
    return t.contiguous()
