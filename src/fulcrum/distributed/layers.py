"""Megatron-style sharding of a Llama-family model over the tensor-parallel ranks::

    embed_tokens   vocabulary-parallel: rows [r * Vp, (r + 1) * Vp) of the (zero-padded) table;
                   ids outside the shard look up zeros, then one all-reduce
    qkv_proj       column-parallel: this rank's query heads, then its KV heads (each rank keeps
                   one KV head, replicated, when there are fewer KV heads than ranks)
    o_proj         row-parallel: the columns of this rank's heads, then one all-reduce
    gate_up_proj   column-parallel: this rank's slice of gate and of up
    down_proj      row-parallel: the matching columns, then one all-reduce
    lm_head        vocabulary-parallel: this rank's logits, all-gathered in rank order and cut
                   back to the vocabulary size
    norms, rotary  replicated

The decoder stack is built from ``local_args`` (this rank's head and MLP counts), so the
attention and MLP code runs unchanged on the smaller shapes; the row-parallel layers get their
all-reduce as a forward hook, whatever their (quantized) class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.distributed.parallel_state import all_gather_last, all_reduce, tp_rank, tp_size
from fulcrum.model.layers.linear import Linear


def vocab_shard(vocab_size: int, world: int) -> int:
    """Rows of each rank's embedding / LM-head shard (the last one zero-padded)."""
    return -(-vocab_size // world)


def local_kv_heads(num_kv_heads: int, world: int) -> int:
    return max(1, num_kv_heads // world)


def local_args(args: Any, world: int) -> Any:
    """A ``ModelArgs`` with this rank's head and MLP counts (hidden size, vocabulary unchanged)."""
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // world,
        num_kv_heads=local_kv_heads(args.num_kv_heads, world),
        intermediate_size=args.intermediate_size // world,
    )


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.shard = vocab_shard(vocab_size, tp_size())
        self.start = tp_rank() * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary rows, gathered from every rank."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_shard(vocab_size, tp_size()), bias=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last(super().forward(x))
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits


def _reduce_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return all_reduce(output)


def parallelize(model: nn.Module) -> None:
    """Swap a causal LM built from ``local_args`` into its tensor-parallel form: vocabulary-
    parallel embedding and LM head (tied again where the model ties them), an all-reduce after
    every ``o_proj`` and ``down_proj``."""
    args = model.args
    body = model.model
    body.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
    model.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size)
    if args.tie_word_embeddings:
        model.lm_head.weight = body.embed_tokens.weight
    for name, m in model.named_modules():
        if name.endswith((".o_proj", ".down_proj")):
            m.register_forward_hook(_reduce_output)
            if hasattr(m, "shard_input"):  # packed formats: act-order slices hold every group
                m.shard_input(tp_size())
