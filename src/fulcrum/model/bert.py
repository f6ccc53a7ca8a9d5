"""BERT-family encoders (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``) for embeddings:
most sentence-transformers checkpoints (all-MiniLM, bge, e5, gte-base, multilingual-e5, bge-m3);
and their ``...ForSequenceClassification`` cross-encoders (ms-marco-MiniLM, bge-reranker),
whose head reads the first token: BERT's pooler (dense, tanh) then ``classifier``, RoBERTa's
``classifier.dense``, tanh, ``classifier.out_proj``.

Each prompt attends to itself in both directions, so it runs whole in one step
(``PoolerConfig.bidirectional``: the scheduler neither chunks it nor matches a cached prefix)
and no layer reads or writes the KV cache. The module tree keeps transformers' names, so a
checkpoint loads by name::

    embeddings:  word + position (+ RoBERTa's offset) + token type 0  -> LayerNorm
    each layer:  x = LN(x + dense(attention(x)))   x = LN(x + output(act(intermediate(x))))

The output is the last layer's hidden states (transformers' ``last_hidden_state``); the pooler
picks CLS, mean or last. BERT's own ``pooler`` (dense + tanh) is not what sentence-transformers
use: an embedding model does not load it. A pair read as one prompt (``[CLS] a [SEP] b [SEP]``)
takes token type 1 after its first ``[SEP]``, as the tokenizer's pair encoding sets it, where
the model has two token types and the loader gave ``sep_token_id``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fulcrum.attention.backend import AttentionMetadata

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# checkpoint prefixes of a model saved with a head (``bert.``) or by a wrapper (``model.``)
_PREFIXES = ("bert.", "roberta.", "model.")
# tensors that are not the encoder's: heads, BERT's pooler, buffers saved as weights
_SKIPPED = ("pooler.", "cls.", "lm_head.", "classifier.", "embeddings.position_ids")
_HEAD = ("pooler.", "classifier.")  # a classifier's: loaded under ``score.``


def _is_roberta(config) -> bool:  # noqa: ANN001 - a transformers config
    return "Roberta" in (getattr(config, "architectures", None) or [""])[0]


class _Embeddings(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, c.type_vocab_size), c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        # RoBERTa numbers positions from its padding index + 1
        self.offset = int(c.pad_token_id) + 1 if _is_roberta(c) else 0

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.position_embeddings(positions + self.offset)
        if types is None:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(types))


class _SelfAttention(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class _Output(nn.Module):
    """``LayerNorm(residual + dense(x))``: the attention's output and the MLP's."""

    def __init__(self, n_in: int, c) -> None:  # noqa: ANN001
        super().__init__()
        self.dense = nn.Linear(n_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class _Attention(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Output(c.hidden_size, c)


class _Intermediate(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Output(c.intermediate_size, c)
        self.heads = int(c.num_attention_heads)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, batch: _Padded) -> torch.Tensor:
        a = self.attention.self
        q, k, v = (batch.pad(p(x), self.heads) for p in (a.query, a.key, a.value))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask)
        x = self.attention.output(batch.unpad(o), x)
        return self.output(self.act(self.intermediate.dense(x)), x)


class _Padded:
    """The step's prompts as one padded batch ``[n, heads, L, D]`` for attention, and back.

    ``rows[i, j]``: prompt ``i``'s token ``j``'s row in the step (``T``, a zero row, past its
    end); ``mask`` lets each query see its own prompt's keys only."""

    def __init__(self, qsl: list[int], device: torch.device) -> None:
        starts = np.asarray(qsl, dtype=np.int64)
        lens = np.diff(starts)
        # the padded length a multiple of 16: SDPA's memory-efficient kernel takes a mask only
        # with aligned rows, else attention falls back to materialising every score
        self.n, self.len, total = len(lens), -(-int(lens.max()) // 16) * 16, int(starts[-1])
        j = np.arange(self.len)
        valid = j[None, :] < lens[:, None]
        rows = np.where(valid, starts[:-1, None] + j[None, :], total)
        self.rows = torch.from_numpy(rows).to(device)
        self.mask = torch.from_numpy(valid).to(device)[:, None, None, :]
        self.flat = torch.from_numpy(np.flatnonzero(valid)).to(device)

    def pad(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])[self.rows]  # [n, L, H * D]
        return x.view(self.n, self.len, heads, -1).transpose(1, 2)

    def unpad(self, o: torch.Tensor) -> torch.Tensor:
        return o.transpose(1, 2).reshape(self.n * self.len, -1)[self.flat]


class _BertHead(nn.Module):
    """``BertForSequenceClassification``'s: pooler (dense, tanh), then ``classifier``."""

    def __init__(self, c, labels: int) -> None:  # noqa: ANN001
        super().__init__()
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.classifier = nn.Linear(c.hidden_size, labels)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(v)))


class _RobertaHead(nn.Module):
    """``RobertaForSequenceClassification``'s ``classifier``: dense, tanh, out_proj."""

    def __init__(self, c, labels: int) -> None:  # noqa: ANN001
        super().__init__()
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.classifier.out_proj = nn.Linear(c.hidden_size, labels)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(v)))


def _pair_types(ids: torch.Tensor, qsl: list[int], sep: int) -> torch.Tensor:
    """Token type 1 after each prompt's first ``sep`` (the second text of a pair), else 0."""
    is_sep = (ids == sep).long()
    seen = torch.cumsum(is_sep, 0) - is_sep  # separators before each token, over the step
    starts = torch.tensor(qsl[:-1], device=ids.device)
    lens = torch.tensor([b - a for a, b in zip(qsl, qsl[1:], strict=False)], device=ids.device)
    seen = seen - torch.repeat_interleave(seen[starts], lens)  # ... within its own prompt
    return (seen > 0).long()


class _Encoder(nn.Module):
    def __init__(self, c) -> None:  # noqa: ANN001
        super().__init__()
        self.layer = nn.ModuleList([_Layer(c) for _ in range(c.num_hidden_layers)])


class BertEncoderModel(nn.Module):
    """An encoder served by ``runner="pooling"``: hidden states of every prompt token."""

    def __init__(self, config, max_model_len: int, backend=None, quant=None,  # noqa: ANN001
                 kernel_config=None) -> None:  # fmt: skip
        super().__init__()
        for field, value, ok in (
            ("position_embedding_type", getattr(config, "position_embedding_type", "absolute"),
             ("absolute",)),
            ("hidden_act", config.hidden_act, tuple(_ACTIVATIONS)),
        ):  # fmt: skip
            if value not in ok:
                raise ValueError(f"{field}: {value!r} is not supported for encoders (only "
                                 f"{', '.join(ok)}).")  # fmt: skip
        if quant is not None:
            raise ValueError("quantization: encoders run unquantized here.")
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.lm_head: nn.Module | None = None  # the loader's NoLMHead: nothing to generate
        # a pair's separator (the loader sets it for a cross-encoder with two token types)
        self.sep_token_id: int | None = None
        self.classifier = (getattr(config, "architectures", None) or [""])[0].endswith(
            "ForSequenceClassification"
        )
        if self.classifier:  # the head the runner applies to each pooled first token
            labels = len(getattr(config, "id2label", None) or {}) or int(config.num_labels)
            head = _RobertaHead if _is_roberta(config) else _BertHead
            self.score = head(config, labels)

    @staticmethod
    def max_positions(config) -> int:  # noqa: ANN001
        """The longest prompt the position table holds (RoBERTa's starts past its padding)."""
        offset = int(config.pad_token_id) + 1 if _is_roberta(config) else 0
        return int(config.max_position_embeddings) - offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,  # noqa: ANN001
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        qsl = meta.query_start_loc_cpu
        batch = _Padded(qsl, input_ids.device)
        sep = self.sep_token_id if self.embeddings.token_type_embeddings.num_embeddings > 1 else None
        types = _pair_types(input_ids, qsl, sep) if sep is not None else None
        x = self.embeddings(input_ids, positions, types)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for p in _PREFIXES:
                name = name.removeprefix(p)
            if self.classifier and name.startswith(_HEAD):
                name = "score." + name
            elif name.startswith(_SKIPPED):
                continue
            # checkpoints converted from TensorFlow name LayerNorm's parameters gamma and beta
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            )
            if name not in params:
                raise ValueError(f"model weights: unexpected tensor {name!r} in the checkpoint.")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"model weights: {name} is {tuple(tensor.shape)}, the model "
                                 f"wants {tuple(params[name].shape)}.")  # fmt: skip
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    def expected_weight_count(self) -> int:
        return sum(1 for _ in self.named_parameters())
