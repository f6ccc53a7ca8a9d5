"""Start-up checks of a tensor-parallel configuration: one line each, naming the numbers."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fulcrum.config import ModelConfig, ParallelConfig
from fulcrum.distributed.gguf_shards import check_gguf_shards
from fulcrum.distributed.packed_shards import check_packed_shards
from fulcrum.distributed.sharding import ShardSpec

# The architectures whose model class shards (model/llama.py's LlamaForCausalLM).
TP_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
)


def validate_parallel(
    pc: ParallelConfig,
    mc: ModelConfig,
    device: torch.device,
    gguf_projections: Iterable[tuple[str, str, int]] = (),
) -> None:
    """Raise ValueError if ``mc`` cannot run over ``pc.tensor_parallel_size`` ranks on
    ``device``. ``gguf_projections``: ``(name, GGUF type, input features)`` of a GGUF file's
    projections (``quantization="gguf"``), whose blocks each rank's slice must keep whole."""
    tp = pc.tensor_parallel_size
    if tp == 1:
        return
    where = f"tensor_parallel_size={tp}"
    if mc.architecture not in TP_ARCHITECTURES:
        raise ValueError(
            f"{where}: {mc.architecture} does not support tensor parallelism; supported: "
            f"{', '.join(TP_ARCHITECTURES)}."
        )
    c = mc.hf_config
    if getattr(c, "attention_bias", False):  # each rank would add o_proj's bias before the sum
        raise ValueError(f"{where}: attention_bias (a bias on o_proj) is not supported.")
    heads, kv = int(c.num_attention_heads), mc.num_kv_heads
    if heads % tp:
        raise ValueError(f"{where} does not divide num_attention_heads={heads}.")
    if kv >= tp and kv % tp:
        raise ValueError(f"{where} does not divide num_key_value_heads={kv}.")
    if kv < tp and tp % kv:
        raise ValueError(
            f"{where} is not a multiple of num_key_value_heads={kv} (fewer KV heads than "
            "ranks are replicated, which needs each to serve the same number of ranks)."
        )
    if int(c.intermediate_size) % tp:
        raise ValueError(f"{where} does not divide intermediate_size={c.intermediate_size}.")
    # Every quantization shards. FP8: a row-parallel rank scales its slice of each row (and of
    # each token's activation) by that slice's own maximum, as close to the float weights as one
    # rank's scaling, not bit-equal to it. GPTQ and AWQ (packed_shards.py) and GGUF's packed
    # blocks (gguf_shards.py) shard exactly where the slices fall on word, group and block
    # boundaries, which these checks require.
    spec = ShardSpec.from_hf(c, 0, tp, mc.quantization)
    if spec.packed is not None:
        check_packed_shards(spec, spec.packed, where)
    check_gguf_shards(spec, gguf_projections, where)
    backend = pc.backend(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"distributed_backend=nccl needs CUDA devices, got device={device}.")
    if device.type == "cuda":
        first = device.index or 0
        have = torch.cuda.device_count() - first
        if tp > have:
            raise ValueError(
                f"{where} needs {tp} GPUs from cuda:{first}, but {max(have, 0)} are visible."
            )
