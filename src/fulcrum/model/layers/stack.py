"""The forward of a decoder stack whose layers pass the hidden state alone between them (Gemma,
OLMo 2: a norm after each sublayer leaves no residual add to fuse into the next norm), whole
and as the piecewise graphs' segments.

A subclass holds ``embed_tokens``, ``layers`` (each with ``before_attention(x, positions,
kv_cache, slots) -> (q, k, v, x)`` and ``after_attention(o, x) -> x``) and the final ``norm``,
and may override ``_embed``."""

from __future__ import annotations

import torch
from torch import nn


class HiddenStateStack(nn.Module):
    def _embed(self, input_ids) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        x = self._embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    # The forward as segments between attention calls, as LlamaModel.segment lays them out; the
    # hidden state travels in the ``residual`` slot.
    def segment(
        self, i: int, positions, slots, kv_cache=None, input_ids=None, o=None, residual=None
    ):
        if i == 0:
            return self.layers[0].before_attention(
                self._embed(input_ids), positions, kv_cache, slots
            )
        prev = self.layers[i - 1]
        x = prev.after_attention(o.reshape(-1, prev.self_attn.q_size), residual)
        if i < len(self.layers):
            return self.layers[i].before_attention(x, positions, kv_cache, slots)
        return self.norm(x)
