"""GGUF → Hugging Face directory conversion, cached on disk so the second load is fast.

Config and tokenizer (with the chat template) are read from the file's metadata through
transformers and saved first (``gguf_metadata_dir``); the weights, dequantized to float32 with
the ``gguf`` package and llama.cpp's Q/K row permutation (its rotary layout) undone, are written
beside them only when a load needs them dequantized (``convert_gguf``). A packed load
(``quantization="gguf"``) reads the file itself and never writes the float32 copy, which for an
8B model would be 32 GB.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fulcrum import envs

if TYPE_CHECKING:
    from fulcrum.distributed.sharding import ShardSpec

logger = logging.getLogger(__name__)

_CONVERTER_VERSION = "1"
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cache_root() -> str:
    root = envs.FULCRUM_CACHE_DIR.get() or os.path.join(
        os.path.expanduser("~"), ".cache", "fulcrum"
    )
    return os.path.join(root, "gguf")


def _cache_dir_for(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"{os.path.basename(path)}-{digest}")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved → half-split rotary layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class _Rows:
    """A GGUF tensor that dequantizes only the rows asked for (``[a:b]``, ``[:]``, ``[:, a:b]``),
    as ``ShardSpec`` reads a tensor-parallel rank's part; llama.cpp's Q/K row order is undone on
    those rows (whole heads: each head's rows are permuted among themselves)."""

    def __init__(self, t: Any, heads: int | None) -> None:  # t: a gguf ReaderTensor
        self.t, self.heads = t, heads

    def __getitem__(self, idx: slice | tuple[slice, ...]) -> torch.Tensor:
        import gguf

        rows, *cols = idx if isinstance(idx, tuple) else (idx,)
        data = self.t.data[rows]
        w = gguf.quants.dequantize(data, self.t.tensor_type).astype(np.float32)
        if self.heads is not None:
            w = _unpermute(w, self.heads * len(data) // len(self.t.data))
        return torch.from_numpy(np.ascontiguousarray(w[(slice(None), *cols)]))


def read_gguf_tensors(
    path: str,
    arch: str,
    n_head: int,
    n_kv_head: int,
    skip: Callable[[str], bool] | None = None,
    shard: Callable[[str, Any], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, float32 tensor) for every tensor of the file (but those whose name
    ``skip(hf_name)`` is true, which are not dequantized); ``shard(name, rows)``: only the part
    a tensor-parallel rank holds is dequantized."""
    from tqdm.auto import tqdm

    for t in tqdm(_reader(path).tensors, desc="Dequantizing GGUF", unit="tensor", leave=False):
        name = _hf_name(t.name)
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue
            raise ValueError(f"model: GGUF tensor {t.name!r} is not supported.")
        if skip is not None and skip(name):
            continue
        rows = _Rows(t, _permuted_heads(arch, name, n_head, n_kv_head))
        yield name, rows[:] if shard is None else shard(name, rows)


def _permuted_heads(arch: str, name: str, n_head: int, n_kv_head: int) -> int | None:
    """The heads of a tensor whose rows llama.cpp permuted for its rotary layout (None: none)."""
    if arch != "llama":
        return None
    proj = name.split(".")[-2]
    return {"q_proj": n_head, "k_proj": n_kv_head}.get(proj)


_META_MARK, _WEIGHTS_MARK = "fulcrum_metadata.json", "fulcrum_converted.json"


def gguf_metadata_dir(path: str) -> str:
    """A directory holding config.json and the tokenizer of ``path`` (no weights yet)."""
    out = _cache_dir_for(path)
    if any(os.path.isfile(os.path.join(out, m)) for m in (_META_MARK, _WEIGHTS_MARK)):
        return out
    from transformers import AutoConfig, AutoTokenizer

    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        config = AutoConfig.from_pretrained(d, gguf_file=f)
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    except Exception as e:  # corrupt or foreign file: say which and why
        raise ValueError(f"model: cannot read GGUF file {path!r}: {e}") from None
    arch = config.model_type
    if arch not in _ARCHS:
        raise ValueError(f"architectures: GGUF architecture {arch!r} is not supported.")
    config.architectures = [_ARCHS[arch]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in _reader(path).tensors)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-")
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _META_MARK), "w") as fh:
            json.dump({"source": os.path.abspath(path)}, fh)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _reader(path: str):
    """The file's reader, shared by the start-up checks and the loads of this process: parsing
    the header walks every metadata value (the whole vocabulary) in Python, seconds for a
    large tokenizer. The reader maps the file; its tensors are read only where used."""
    st = os.stat(path)
    return _open_reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def convert_gguf(path: str) -> str:
    """Return a directory holding config.json, model.safetensors and the tokenizer for ``path``."""
    out = gguf_metadata_dir(path)
    if os.path.isfile(os.path.join(out, _WEIGHTS_MARK)):
        return out
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    logger.info("Converting %s once into %s (cached for the next load)", path, out)
    with open(os.path.join(out, "config.json")) as fh:
        c = json.load(fh)
    n_head = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads") or n_head
    tensors = dict(read_gguf_tensors(path, c["model_type"], n_head, n_kv))
    tmp = os.path.join(out, f".model-{os.getpid()}.safetensors")
    try:
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(out, "model.safetensors"))
    finally:
        if os.path.isfile(tmp):
            os.remove(tmp)
    with open(os.path.join(out, _WEIGHTS_MARK), "w") as fh:
        json.dump({"source": os.path.abspath(path), "seconds": time.perf_counter() - t0}, fh)
    logger.info("GGUF conversion took %.1f s", time.perf_counter() - t0)
    return out


def _projections(path: str) -> Iterator[tuple[Any, str]]:
    """(GGUF tensor, hf name) of every projection weight of the file."""
    for t in _reader(path).tensors:
        name = _hf_name(t.name)
        if name is not None and name.endswith("_proj.weight"):
            yield t, name


def projection_types(path: str) -> list[tuple[str, str, int]]:
    """``(hf name, GGUF type, input features)`` of every projection weight of the file."""
    return [(name, t.tensor_type.name, int(t.shape[0])) for t, name in _projections(path)]


def iter_gguf_packed(
    path: str, hf_config: Any, shard: ShardSpec | None = None
) -> Iterator[tuple[str, Any]]:
    """(name, value) for ``quantization="gguf"``: each projection's raw blocks as
    ``<proj>.blocks`` (``quant/gguf.py``'s ``GgufBlocks``, repacked by the layer once all its
    shards are in), then every other tensor of the file dequantized (embeddings, norms, the LM
    head): no float32 copy of the projections is made. ``shard`` (a ``ShardSpec``): only this
    tensor-parallel rank's blocks and rows are read (``distributed/gguf_shards.py``)."""
    from fulcrum.distributed.gguf_shards import block_slice
    from fulcrum.quant.gguf import PACKED_TYPES, GgufBlocks

    arch = hf_config.model_type
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    packed: set[str] = set()
    for t, name in _projections(path):
        type_name = t.tensor_type.name
        if type_name not in PACKED_TYPES:
            raise ValueError(
                f"quantization: GGUF tensor {t.name!r} ({name}) has type {type_name}; packed "
                f"GGUF supports {', '.join(PACKED_TYPES)}; load it with quantization none "
                "(dequantized at load)."
            )
        k, n = (int(v) for v in t.shape[:2])
        data = np.asarray(t.data).reshape(n, -1)  # one output row's blocks a row
        if shard is not None:  # a view of the memory map: only the slice's bytes are read
            data, n, k = block_slice(shard, name, type_name, data, k)
        heads = _permuted_heads(arch, name, n_head, n_kv)
        if heads is not None:  # llama.cpp's rotary row order, undone on whole heads
            data = _unpermute(data, heads * n // int(t.shape[1]))
        yield name.removesuffix(".weight") + ".blocks", GgufBlocks(type_name, data, n, k)
        packed.add(name)
    yield from read_gguf_tensors(path, arch, n_head, n_kv, packed.__contains__, shard)
