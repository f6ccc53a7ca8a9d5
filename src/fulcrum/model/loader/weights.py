"""Build the model and fill its weights: safetensors (sharded, with index), converted GGUF, dummy."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import time

import torch
from torch import nn

from fulcrum.attention.backend import AttentionBackend
from fulcrum.config import KernelConfig, ModelConfig

logger = logging.getLogger(__name__)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"model weights: corrupt index {index!r}: {e}") from None
        files = sorted({os.path.join(path, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"model weights: shard {missing[0]!r} named in the index is missing.")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model weights: no *.safetensors files in {path!r}.")
    return files


def iter_safetensors(path: str, shard=None):
    """``(name, tensor)`` of every checkpoint tensor; ``shard(name, lazy slice)``: only the
    part this tensor-parallel rank holds is read."""
    from safetensors import SafetensorError, safe_open

    for f in _safetensors_files(path):
        try:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    if shard is None:
                        yield name, fh.get_tensor(name)
                    else:
                        yield name, shard(name, fh.get_slice(name))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model weights: cannot read {f!r}: {e}") from None


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights on the model's device (no CPU round trip), scaled to keep activations sane.
    A quantized layer (``init_dummy``) draws full-precision rows a chunk at a time and stores
    them quantized, so the model never exists in full precision."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    own = {}
    for name, m in model.named_modules():
        if hasattr(m, "init_dummy"):
            m.init_dummy(gen)
            own.update({f"{name}.{n}": p for n, p in m.named_parameters()})
    for name, p in model.named_parameters():
        if name in own:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.02, 0.02, generator=gen)


@contextlib.contextmanager
def _no_default_init():
    """``nn.Linear`` and ``nn.Embedding`` skip their own random init while the model is built:
    the checkpoint or the dummy init then writes every parameter (``load_model`` checks the
    count), so that init was work thrown away: SmolLM2-135M on two CPU cores loaded in
    0.9-1.0 s instead of 1.6-1.9 s (dummy, bf16), 0.4-0.9 s instead of 1.1-1.3 s (GGUF)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, fn in saved:
            cls.reset_parameters = fn


def tp_shard(mc: ModelConfig):
    """This rank's slicing of the checkpoint under tensor parallelism (None: one rank)."""
    from fulcrum.distributed.parallel_state import tp_rank, tp_size

    if tp_size() == 1:
        return None
    from fulcrum.distributed.sharding import ShardSpec

    return ShardSpec.from_hf(mc.hf_config, tp_rank(), tp_size(), mc.quantization)


class NoLMHead(nn.Module):
    """An embedding model's LM head (``runner="pooling"``): logits of zeros. The engine's step
    still samples one token per finished prompt (dropped: the request's output is its pooled
    hidden states), so the sampling path stays the text models' one, at no vocabulary GEMM."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], self.vocab_size)


def _decoder_weights(weights, label_ids: tuple[int, ...] = (), rows: dict | None = None):
    """An embedding model's tensors under the causal LM's names: a bare decoder's checkpoint
    (``Qwen3Model``: ``layers.0...``) gains the ``model.`` prefix; an LM head is not loaded
    (but its ``label_ids`` rows are kept in ``rows``); a classifier's ``score`` head keeps its
    name."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            if label_ids and rows is not None and name == "lm_head.weight":
                rows.update({i: tensor[i].clone() for i in label_ids})
            continue
        keep = name.startswith(("model.", "score."))
        yield (name if keep else "model." + name), tensor


def _label_head(model: nn.Module, ids: tuple[int, ...], rows: dict[int, torch.Tensor]) -> str:
    """A causal-LM reranker's score head from its LM head's label rows (tied: the embedding's):
    two tokens (no, yes) give yes minus no, so the sigmoid of the score is P(yes) of the pair's
    softmax; more give one label each. Returns the parameter's loaded-key."""
    if not rows:  # tied embeddings: the LM head is the input embedding
        emb = model.model.embed_tokens.weight
        rows = {i: emb[i] for i in ids}
    w = [rows[i].to(model.score.weight) for i in ids]
    model.score.weight.data.copy_(torch.stack([w[1] - w[0]] if len(w) == 2 else w))
    return "score.weight#None"


def load_model(
    mc: ModelConfig,
    backend: AttentionBackend,
    device: torch.device,
    kernel_config: KernelConfig | None = None,
) -> tuple[nn.Module, float]:
    """Return the model on ``device`` in ``mc.dtype`` and the load time in seconds; its layers
    hold ``kernel_config`` (None: the defaults)."""
    from fulcrum.model.registry import get_model_cls
    from fulcrum.quant import get_quant_method

    t0 = time.perf_counter()
    cls = get_model_cls(mc.architecture)
    quant = get_quant_method(mc.quantization, getattr(mc.hf_config, "quantization_config", None))
    old = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device), _no_default_init():
            kc = kernel_config if kernel_config is not None else KernelConfig()
            model = cls(mc.hf_config, mc.max_model_len, backend, quant=quant, kernel_config=kc)
    finally:
        torch.set_default_dtype(old)
    if mc.pooler_config is not None:  # an embedding model: hidden states, no vocabulary
        model.lm_head = NoLMHead(mc.vocab_size)
        if mc.pooler_config.bidirectional:  # an encoder (its classifier head is its own)
            model.sep_token_id = mc.pooler_config.sep_token_id
        elif mc.pooler_config.num_labels:  # a classifier's head, on the pooled vector
            hidden = int(mc.hf_config.hidden_size)
            model.score = nn.Linear(hidden, mc.pooler_config.num_labels, bias=False,
                                    device=device, dtype=mc.dtype)  # fmt: skip
    # Buffers (the rotary cache) stay float32.
    for buf in model.buffers():
        if buf.is_floating_point():
            buf.data = buf.data.float()
    for name, m in model.named_modules():  # a packed format refuses a layer it cannot describe
        if hasattr(m, "check_format"):
            m.check_format(name)
    if mc.load_format == "dummy":
        _init_dummy(model, mc.seed)
    else:
        shard = tp_shard(mc)
        if mc.load_format == "gguf":
            from fulcrum.model.loader import gguf_loader

            if mc.quantization == "gguf":  # the projections' blocks from the file, kept packed
                weights = gguf_loader.iter_gguf_packed(mc.model, mc.hf_config, shard)
            else:  # dequantized once into the cache directory
                weights = iter_safetensors(gguf_loader.convert_gguf(mc.model), shard)
        else:
            weights = iter_safetensors(mc.weights_path, shard)
        rows: dict[int, torch.Tensor] = {}  # a causal-LM reranker's label rows of its LM head
        if mc.pooler_config is not None and not mc.pooler_config.bidirectional:
            weights = _decoder_weights(weights, mc.pooler_config.label_token_ids, rows)
        loaded = model.load_weights(weights)
        if mc.pooler_config is not None and mc.pooler_config.label_token_ids:
            loaded.add(_label_head(model, mc.pooler_config.label_token_ids, rows))
        expected = model.expected_weight_count()
        if len(loaded) != expected:
            raise ValueError(
                f"model weights: checkpoint in {mc.weights_path!r} filled {len(loaded)} of "
                f"{expected} parameter shards; it is incomplete or for another model."
            )
        for m in model.modules():  # packed checkpoints: into the kernels' layout, once
            if hasattr(m, "finish_loading"):
                m.finish_loading()
    model.eval()
    dt = time.perf_counter() - t0
    q = f", {mc.quantization} weights" if quant is not None else ""
    logger.info("Loaded %s (%s%s) in %.2f s", mc.model, mc.load_format, q, dt)
    return model, dt
