"""EngineArgs: every engine knob in one dataclass, shared by ``LLM(...)`` and the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fulcrum.config import (
    POOLING_TYPES,
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_max_num_batched_tokens,
    describe_kernel_config,
    resolve_device,
    resolve_dtype,
)
from fulcrum.model.loader.pooling import RUNNERS, resolve_pooler

if TYPE_CHECKING:
    import torch

    from fulcrum.quant.base import QuantMethod


def _help_with_default(text: str) -> str:
    """Append argparse's default unless the help text already names its own (a None default
    there means "the model's", "the embedded model", ... which the text says better)."""
    return text if "default" in text.lower() else text + " (default: %(default)s)"


_HELP = {
    "model": "Model: a Hugging Face directory, a .gguf file, or a name/path under configs/ with "
    "--load-format dummy. Default: the embedded SmolLM2-135M-Instruct.",
    "tokenizer": "Tokenizer directory (default: the model's own).",
    "dtype": "Weight and activation dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
    "float16, bfloat16.",
    "device": "Device: auto, cpu, cuda, cuda:N.",
    "load_format": "Weight format: auto, safetensors, gguf, dummy (random weights for benchmarks).",
    "block_size": "Tokens per KV-cache block.",
    "max_num_seqs": "Maximum concurrent sequences in one step.",
    "max_num_batched_tokens": "Token budget of one step (prefill chunks + decodes + speculative "
    "tokens). Default: 8192 on a CUDA GPU with at least 70 GiB (fewer, larger prefill steps, so "
    "under load most steps are decode-only), else 2048.",
    "max_model_len": "Maximum context length (prompt + output). Default: the model's, capped by "
    "what the KV cache holds.",
    "kv_cache_memory": "KV-cache size in GiB (default on CPU: 2 GiB).",
    "host_kv_cache_memory": "GiB of host memory (pinned on CUDA) under the prefix cache: blocks "
    "the device evicts are copied there, and a later request with that prefix gets them copied "
    "back instead of recomputed (multi-turn chats, RAG contexts that outgrow the device); 0: "
    "off. Not with a draft model or sliding-window layers.",
    "gpu_memory_utilization": "Fraction of GPU memory fulcrum may use (weights + activations + KV).",
    "num_kv_blocks": "Exact number of KV-cache blocks (overrides the memory-based sizing).",
    "quantization": "Weight quantization of the decoder's linear layers: none, or fp8 (float8 "
    "e4m3 weights with a scale per output row, activations quantized per token, FP8 tensor-core "
    "GEMMs: half the weight bytes; GPUs of compute capability 8.9+, or the CPU). Checkpoints in "
    "full precision are quantized as they load; gptq or awq (weight-only 4-bit integers, 8-bit "
    "for gptq, kept packed; Triton W4A16 kernels on CUDA). A checkpoint whose config.json has a "
    "gptq or awq quantization_config selects its method itself; gguf (a GGUF file's Q4_0, Q4_1, "
    "Q8_0, Q4_K, Q5_K and Q6_K projections kept packed for Triton kernels; default: dequantized "
    "at load).",
    "kv_cache_dtype": "KV-cache storage: auto (the model's dtype) or fp8 (float8 e4m3, scale 1.0: "
    "half the bytes per token, so twice the tokens fit and decode reads half as much KV).",
    "enable_prefix_caching": "Reuse KV of shared prompt prefixes across requests (radix cache).",
    "schedule_policy": "Waiting-queue order: fcfs, or lpm (longest cached prefix first).",
    "seed": "Seed for weight init (dummy) and for unseeded sampling.",
    "attention_backend": "Attention implementation: auto, torch, triton.",
    "enforce_eager": "Disable CUDA graphs (always eager on CPU).",
    "async_scheduling": "Schedule step N+1 while the device runs step N (hides the host's "
    "bookkeeping behind the GPU): auto (on with CUDA), on, off.",
    "piecewise_graph_max_tokens": "Run prefill and mixed steps of up to this many tokens through "
    "CUDA graphs captured per token bucket around attention, which runs eagerly in between "
    "(cuts the host's launch work for short prompts: an 8B model's 128-token prompt answers in "
    "~6 ms instead of ~13 on an H200; CUDA only, not with --enforce-eager; 0: off).",
    "kernel_config": "The kernels' fast paths and launch settings as JSON, e.g. "
    '\'{"pdl": {"enabled": false}, "gemv": {"max_m": 0}}\'; fields not named keep their '
    "defaults (README: Switches). Fields: ",
    "tensor_parallel_size": "Tensor parallelism: shard the model over this many devices (one "
    "process per rank; NCCL on CUDA, gloo on the CPU). Attention heads (and KV heads, when "
    "there are more of them than ranks) must divide evenly.",
    "distributed_backend": "torch.distributed backend of tensor parallelism: auto (nccl on CUDA, "
    "gloo on the CPU), nccl, gloo.",
    "worker_timeout": "Seconds a tensor-parallel rank may take to start, or to answer one step's "
    "collective, before the engine fails naming the rank.",
    "lora_modules": "LoRA adapters to serve beside the base model, each NAME=PATH (a PEFT "
    "adapter directory: adapter_config.json and adapter_model.safetensors); a request selects "
    "one by its model name. Decode steps with adapter rows replay their own CUDA graphs; "
    "prefill steps with adapter rows run eagerly.",
    "max_loras": "LoRA adapters the device holds at once (slots, each served at full speed in "
    "any mix); 0: one per --lora-modules adapter, and one if there are none and runtime "
    "updates are on.",
    "max_lora_rank": "The largest LoRA rank a slot holds (the slots' memory grows with it); 0: "
    "the largest --lora-modules adapter's rank, and at least 16 with runtime updates.",
    "allow_runtime_lora_updates": "Let adapters be loaded into free slots and unloaded while "
    "serving (POST /v1/load_lora_adapter and /v1/unload_lora_adapter, LLM.load_lora_adapter): "
    "whoever reaches the server can then make it read adapter directories from its disk. "
    "Every projection of every layer then takes adapters.",
    "hf_overrides": "config.json fields to replace, as JSON, e.g. '{\"max_position_embeddings\": "
    "65536}' or, for a reranker kept as a causal LM (Qwen3-Reranker), '{\"architectures\": "
    "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"]}' "
    "(its score is the LM head's yes-minus-no logit).",
    "runner": "What the model serves: generate (text), pooling (embeddings: /v1/embeddings, "
    "LLM.embed; a causal LM's checkpoint is served by its decoder's hidden states) or auto "
    "(pooling for a bare decoder without an LM head, such as Qwen3Model or MistralModel; "
    "generate otherwise).",
    "pooling_type": "How runner pooling turns a prompt's final hidden states into one vector: "
    "last (the last token's, what decoder embedding models use), mean, or cls (the first "
    "token's). Default: the checkpoint's sentence-transformers Pooling config, else last.",
    "embedding_normalize": "Scale each embedding to unit L2 norm (runner pooling): auto (as "
    "the checkpoint's sentence-transformers modules say; on without them), on, off.",
    "speculative_config": "Speculative decoding as JSON in vLLM's names, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; methods: '
    "ngram (prompt lookup), suffix (suffix trees over this and recent requests), draft_model "
    '(a smaller model with the same vocabulary, "model": its path or configs/ name). Default: '
    "off.",
}


def _kernel_config_help() -> str:
    fields = ", ".join(name for name, *_ in describe_kernel_config())
    return _HELP["kernel_config"] + fields + "."


def parse_kernel_config(value: str | Mapping[str, Any] | KernelConfig | None) -> KernelConfig:
    """``--kernel-config``'s JSON, a dict of the same shape, or a config: a ``KernelConfig``.
    An unknown key or a value of the wrong type raises ValueError naming it."""
    if value is None:
        return KernelConfig()
    if isinstance(value, KernelConfig):
        return value
    return KernelConfig.from_dict(parse_json_object(value, "kernel_config") or {})


def parse_json_object(value: str | Mapping[str, Any] | None, field: str) -> dict[str, Any] | None:
    """A JSON object given as text or as a dict; ValueError naming ``field`` otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e}).") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{field}: expected a JSON object, got {type(value).__name__}.")
    return dict(value)


def _cli_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser: its ValueError is printed with the flag's name (exit 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


_cli_json_object = _cli_type(lambda text: parse_json_object(text, "hf_overrides"))
_cli_kernel_config = _cli_type(parse_kernel_config)


def parse_speculative_config(
    value: str | Mapping[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON, a dict of the same shape, or a config. An unknown key,
    a wrong type or a bad value raises ValueError naming the field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e}).") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config: expected a JSON object, got {value!r}.")
    return SpeculativeConfig.from_dict(value)


_cli_speculative_config = _cli_type(parse_speculative_config)


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: default_max_num_batched_tokens(device)
    max_model_len: int | None = None
    kv_cache_memory: float | None = None
    host_kv_cache_memory: float = 0.0
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: str = "auto"
    piecewise_graph_max_tokens: int = 1024
    # a KernelConfig, or a dict (JSON from the CLI) of the fields to change; None: the defaults
    kernel_config: KernelConfig | dict[str, Any] | str | None = None
    # a SpeculativeConfig, or a dict (JSON from the CLI) in vLLM's names; None: no speculation
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"
    worker_timeout: float = 120.0
    # name -> PEFT adapter directory, or "name=path" strings (the CLI's form); None: no LoRA
    lora_modules: Mapping[str, str] | list[str] | None = None
    max_loras: int = 0
    max_lora_rank: int = 0
    allow_runtime_lora_updates: bool = False
    # config.json fields to replace (a dict, or JSON from the CLI); None: the file as it is
    hf_overrides: dict[str, Any] | str | None = None
    runner: str = "auto"
    pooling_type: str | None = None  # None: the checkpoint's sentence-transformers config, else last
    embedding_normalize: str = "auto"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.name == "kernel_config":  # JSON text, parsed (and checked) with the config
                g.add_argument(
                    flag, type=_cli_kernel_config, default=None, help=_kernel_config_help()
                )
                continue
            if f.name == "hf_overrides":
                g.add_argument(flag, type=_cli_json_object, default=None, help=_HELP[f.name])
                continue
            if f.name == "lora_modules":
                g.add_argument(flag, nargs="+", metavar="NAME=PATH", default=None,
                               help=_HELP[f.name])  # fmt: skip
                continue
            if f.name == "speculative_config":
                g.add_argument(
                    flag, type=_cli_speculative_config, default=None, help=_HELP[f.name]
                )
                continue
            if isinstance(default, bool):
                g.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=_help_with_default(_HELP[f.name]),
                )
                continue
            base = str(f.type).split(" ")[0]
            typ = {"int": int, "float": float}.get(base, str)
            choices = {
                "async_scheduling": ["auto", "on", "off"],
                "kv_cache_dtype": ["auto", "fp8"],
                "quantization": ["none", "fp8", "gptq", "awq", "gguf"],
                "distributed_backend": ["auto", "nccl", "gloo"],
                "runner": list(RUNNERS),
                "pooling_type": list(POOLING_TYPES),
                "embedding_normalize": ["auto", "on", "off"],
            }.get(f.name)
            g.add_argument(
                *([flag, "-tp"] if f.name == "tensor_parallel_size" else [flag]),
                type=typ,
                default=default,
                choices=choices,
                help=_help_with_default(_HELP[f.name]),
            )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (config, weights, tokenizer) and size every config."""
        from fulcrum.model.loader.resolve import resolve_model_config

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(
                f"async_scheduling: expected auto, on or off, got {self.async_scheduling!r}."
            )
        if self.piecewise_graph_max_tokens < 0:
            raise ValueError(
                "piecewise_graph_max_tokens must be 0 (off) or positive, got "
                f"{self.piecewise_graph_max_tokens}."
            )
        kernel_config = parse_kernel_config(self.kernel_config)
        # Checked before the model resolves, so a bad value fails as one line naming the field
        # instead of in the engine core's start-up.
        _check_attention_backend(self.attention_backend, device)
        if device.type == "cpu":  # on CUDA the pool is sized (and checked) against free memory
            _check_cpu_kv_memory(self.kv_cache_memory, self.tensor_parallel_size)
        from fulcrum.model.loader.tokenizer import check_tokenizer_path

        check_tokenizer_path(self.tokenizer)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = default_max_num_batched_tokens(device)
        spec_config = parse_speculative_config(self.speculative_config)
        if spec_config is not None and spec_config.num_speculative_tokens >= budget:
            raise ValueError(
                "speculative_config.num_speculative_tokens: "
                f"{spec_config.num_speculative_tokens} proposed tokens plus one do not fit "
                f"max_num_batched_tokens={budget}."
            )
        from fulcrum.quant import get_quant_method
        from fulcrum.spec_decode.draft_config import resolve_draft_config

        quant = get_quant_method(self.quantization)  # unknown name: ValueError naming the field
        if quant is not None:
            quant.check_device(device)
        model_config = resolve_model_config(
            self.model,
            tokenizer=self.tokenizer,
            load_format=self.load_format,
            dtype=dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            hf_overrides=parse_json_object(self.hf_overrides, "hf_overrides"),
        )
        pooler = resolve_pooler(self.runner, self.pooling_type, self.embedding_normalize, model_config)
        model_config = dataclasses.replace(model_config, pooler_config=pooler)
        quant = _checkpoint_quant(quant, model_config)
        if quant is not None:
            quant.check_device(device)
            model_config = dataclasses.replace(model_config, quantization=quant.name)
        from fulcrum.distributed.validate import validate_parallel

        parallel_config = ParallelConfig(
            self.tensor_parallel_size, self.distributed_backend, self.worker_timeout
        )
        gguf_projections = []
        if model_config.quantization == "gguf" and self.tensor_parallel_size > 1:
            from fulcrum.model.loader.gguf_loader import projection_types

            gguf_projections = projection_types(model_config.model)  # the file's types
        validate_parallel(parallel_config, model_config, device, gguf_projections)
        draft_model_config = resolve_draft_config(spec_config, model_config)
        if draft_model_config is not None and parallel_config.tensor_parallel_size > 1:
            # The draft's weights and KV live in the driver's worker unsharded; ranks > 0 would
            # run target passes the driver's draft never saw.
            raise ValueError(
                'speculative_config.method "draft_model" is not supported with '
                f"tensor_parallel_size={parallel_config.tensor_parallel_size} yet; use ngram or "
                "suffix, or one rank."
            )
        lora_config = dataclasses.replace(
            parse_lora_modules(self.lora_modules),
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            runtime_updates=self.allow_runtime_lora_updates,
        )
        if lora_config.enabled and draft_model_config is not None:
            raise ValueError(
                'lora_modules: LoRA adapters are not supported with speculative_config.method '
                '"draft_model" (the draft has no adapters); ngram and suffix work.'
            )
        if pooler is not None:
            _check_pooling(spec_config)
            if pooler.label_token_ids and parallel_config.tensor_parallel_size > 1:
                raise ValueError(
                    "hf_overrides: classifier_from_token reads the whole LM head; it is not "
                    "supported with tensor_parallel_size > 1 yet."
                )
            if pooler.bidirectional and lora_config.enabled:
                raise ValueError(f"lora_modules: the encoder {model_config.architecture} takes no "
                                 "LoRA adapters.")  # fmt: skip
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            host_kv_cache_memory=self.host_kv_cache_memory,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=model_config.max_model_len,
            schedule_policy=self.schedule_policy,
        )
        config = EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device=device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager or device.type != "cuda",
            async_scheduling=self.async_scheduling == "on"
            or (self.async_scheduling == "auto" and device.type == "cuda"),
            piecewise_graph_max_tokens=self.piecewise_graph_max_tokens,
            kernel_config=kernel_config,
            speculative_config=spec_config,
            draft_model_config=draft_model_config,
            parallel_config=parallel_config,
            lora_config=lora_config,
        )
        if self.host_kv_cache_memory:
            from fulcrum.engine.core import engine_kv_window

            # the tier copies the model's own KV blocks: a draft's pool would go stale, and a
            # window's released blocks are no cached prefix
            if draft_model_config is not None or engine_kv_window(config) is not None:
                raise ValueError("host_kv_cache_memory: not supported with a draft model or "
                                 "sliding-window layers yet.")  # fmt: skip
        return config


def _check_pooling(spec: SpeculativeConfig | None) -> None:
    """An embedding model computes each prompt once and generates nothing."""
    if spec is not None:
        raise ValueError(
            "speculative_config: runner pooling computes embeddings; nothing is generated to "
            "speculate on."
        )


def parse_lora_modules(value: Mapping[str, str] | list[str] | None) -> LoRAConfig:
    """``{name: path}`` or ``["name=path", ...]`` -> ``LoRAConfig``; each path must be a PEFT
    adapter directory (checked here, so a typo fails as one line naming the field)."""
    if not value:
        return LoRAConfig()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = []
        for item in value:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"lora_modules: expected NAME=PATH, got {item!r}.")
            pairs.append((name, path))
    for name, path in pairs:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(
                f"lora_modules: {name}={path} is not a PEFT adapter directory (no "
                "adapter_config.json)."
            )
    return LoRAConfig(tuple((n, os.path.abspath(p)) for n, p in pairs))


def _check_attention_backend(name: str, device: torch.device) -> None:
    """An unknown name raises the registry's own ValueError (which lists the backends)."""
    if name == "auto":  # always resolves; looking it up would import Triton here on CUDA
        return
    from fulcrum.attention.selector import get_backend_cls

    try:
        get_backend_cls(name, device)
    except ImportError as e:  # a known backend whose package is not installed
        raise ValueError(f"attention_backend: {name} cannot be imported ({e}).") from None


def _physical_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return None


def _check_cpu_kv_memory(gib: float | None, ranks: int) -> None:
    """A CPU KV pool larger than the machine's RAM fails at allocation inside the engine core,
    as a traceback after the model loaded; say so at start-up instead. Each tensor-parallel
    rank allocates ``gib`` of its own."""
    ram = _physical_ram_bytes()
    if gib is None or ram is None or gib * ranks * 2**30 <= ram:
        return
    size = f"{gib:g} GiB" if ranks == 1 else f"{gib:g} GiB x {ranks} ranks"
    raise ValueError(
        f"kv_cache_memory: {size} is more than this machine's RAM ({ram / 2**30:.1f} GiB)."
    )


_PACKED_METHODS = ("gptq", "awq")


def _checkpoint_quant(quant: QuantMethod | None, mc: ModelConfig) -> QuantMethod | None:
    """The method a checkpoint's ``quantization_config`` asks for (as vLLM and transformers
    read it), checked against the one requested; ``quant`` where the checkpoint has none."""
    from fulcrum.quant import get_quant_method

    if quant is not None and quant.name == "gguf" and mc.load_format != "gguf":
        raise ValueError(
            f"quantization: gguf keeps a GGUF file's blocks packed; {mc.model!r} is not one."
        )
    qc = getattr(mc.hf_config, "quantization_config", None)
    if not isinstance(qc, dict):
        if quant is not None and quant.name in _PACKED_METHODS and mc.load_format != "dummy":
            raise ValueError(
                f"quantization: {quant.name} reads {quant.name} checkpoints (config.json with a "
                f"quantization_config); {mc.model!r} has none (dummy weights need none)."
            )
        return quant
    method = str(qc.get("quant_method", "")).lower()
    if method not in _PACKED_METHODS:
        raise ValueError(
            f"quantization_config.quant_method: checkpoints quantized with {method!r} are not "
            f"supported; expected one of {', '.join(_PACKED_METHODS)}."
        )
    if quant is not None and quant.name != method:
        raise ValueError(
            f"quantization: the checkpoint is {method}-quantized (config.json "
            f"quantization_config), got {quant.name!r}."
        )
    return get_quant_method(method, qc)
