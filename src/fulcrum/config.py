"""Frozen configuration dataclasses shared by every subsystem."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fulcrum import envs

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: unknown device {device!r} ({e}).") from None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (exact against the reference) and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype: unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}."
        )
    return _DTYPES[dtype]


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolerConfig:
    """Embeddings instead of text (``runner="pooling"``): each prompt's hidden states after the
    decoder's final norm, pooled into one vector per prompt. ``last``: the last prompt token's
    (decoder embedding models: Qwen3-Embedding, e5-mistral, gte-Qwen2); ``mean``: the average
    over every prompt token; ``cls``: the first token's. ``normalize``: scaled to unit L2 norm
    (after a request's ``dimensions`` cut, if it asks for one). ``num_labels`` > 0: a sequence
    classifier (``...ForSequenceClassification``: rerankers, reward and intent models), whose
    ``score`` head turns the pooled vector into that many logits."""

    pooling_type: str = "last"
    normalize: bool = True
    num_labels: int = 0
    # a reranker kept as a causal LM (config ``classifier_from_token``): its labels are the LM
    # head's rows of these tokens; two tokens (no, yes) give one label, yes minus no
    label_token_ids: tuple[int, ...] = ()
    # an encoder (BERT): each prompt attends both ways, so it runs whole in one step, unchunked
    bidirectional: bool = False
    # an encoder cross-encoder's pair separator: token type 1 follows its first occurrence
    sep_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type: expected one of {', '.join(POOLING_TYPES)}, got "
                f"{self.pooling_type!r}."
            )

    @property
    def whole_prompt(self) -> bool:
        """Whether every prompt position must run through the model in this request (mean and
        cls read hidden states a cached prefix would skip); ``last`` always computes the last
        prompt token, so the prefix cache serves it; an encoder's every position depends on
        the whole prompt."""
        return self.pooling_type != "last" or self.bidirectional


@dataclass(frozen=True)
class ModelConfig:
    """What to run: the resolved architecture config plus where its weights and tokenizer live."""

    model: str  # path given by the user (dir, .gguf file, or configs/ name for dummy)
    hf_config: Any  # transformers.PretrainedConfig
    weights_path: str  # directory holding *.safetensors (or the .gguf file)
    tokenizer_path: str | None  # directory loadable by AutoTokenizer (None: no tokenizer)
    load_format: str  # "safetensors" | "gguf" | "dummy"
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    quantization: str | None = None  # weight format of the decoder's projections (quant/)
    pooler_config: PoolerConfig | None = None  # runner "pooling": embeddings; None: text

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    Its size is ``num_blocks`` if given, else ``kv_cache_memory`` GiB (CPU), else the free GPU
    memory under ``gpu_memory_utilization`` after a profiling forward pass (CUDA).
    """

    block_size: int = 16
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (see kv_cache.dtype)
    # GiB of host memory that keeps prefix blocks the device cache evicts (0: none; see
    # kv_cache/host_tier.py): a later request with that prefix copies them back
    host_kv_cache_memory: float = 0.0

    def __post_init__(self) -> None:
        from fulcrum.kv_cache.dtype import KV_CACHE_DTYPES

        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.cache_dtype!r}."
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive GiB, got {self.kv_cache_memory}.")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {self.num_blocks}.")
        if self.host_kv_cache_memory < 0:
            raise ValueError(
                f"host_kv_cache_memory must be >= 0 GiB, got {self.host_kv_cache_memory}."
            )
        if self.host_kv_cache_memory and not self.enable_prefix_caching:
            raise ValueError("host_kv_cache_memory: keeps evicted prefix-cache blocks; it needs "
                             "enable_prefix_caching.")  # fmt: skip


# The step budget when none is given. A large GPU takes fewer, larger prefill steps: under load
# most steps are then decode-only, so a stream's inter-token gaps rarely meet a prefill chunk (the
# budget vLLM serves with on such GPUs too); a small one keeps each mixed step short.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
LARGE_GPU_MIN_GIB = 70


def default_max_num_batched_tokens(device: torch.device) -> int:
    """The step budget when none is given: larger on a GPU with room for big prefill steps."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if total >= LARGE_GPU_MIN_GIB * 2**30:
            return LARGE_GPU_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per step shared by decodes, prefill chunks and speculative tokens."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    schedule_policy: str = "fcfs"  # "fcfs" | "lpm"
    # LPM degrades to FCFS beyond this many waiting requests (sorting cost, starvation).
    lpm_max_queue: int = 128

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}."
            )



DISTRIBUTED_BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (PEFT checkpoints), each by name; a request
    names one (or none: the base model). The device holds ``num_slots`` adapters at once, each
    up to ``max_lora_rank``; adapter ``i`` of ``adapters`` starts in slot ``i + 1`` (slot 0 is
    the base model). With ``runtime_updates``, adapters are loaded into free slots and unloaded
    while serving (``/v1/load_lora_adapter``, ``LLM.load_lora_adapter``)."""

    adapters: tuple[tuple[str, str], ...] = ()  # (name, adapter directory), loaded at start
    max_loras: int = 0  # adapter slots; 0: one per startup adapter (at least one for updates)
    max_lora_rank: int = 0  # 0: the largest startup adapter's rank (at least 16 for updates)
    runtime_updates: bool = False  # adapters may be loaded and unloaded while serving

    def __post_init__(self) -> None:
        names = [n for n, _ in self.adapters]
        for name in names:
            self.check_name(name, "lora_modules")
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"lora_modules: adapter name {sorted(dup)[0]!r} is given twice.")
        if self.max_loras < 0 or self.max_lora_rank < 0:
            field = "max_loras" if self.max_loras < 0 else "max_lora_rank"
            raise ValueError(f"{field} must be >= 0 (0: the default), got {getattr(self, field)}.")
        if self.max_loras and self.max_loras < len(names):
            raise ValueError(f"max_loras: {self.max_loras} slots cannot hold the {len(names)} lora_modules adapters.")

    @staticmethod
    def check_name(name: object, field: str) -> None:
        """An adapter's name is what requests send as ``model``: ValueError naming ``field``
        unless it is a non-empty string without '=' or spaces at either end."""
        if not isinstance(name, str) or not name or "=" in name or name != name.strip():
            raise ValueError(f"{field}: adapter name {name!r} must be non-empty, without '=' or spaces at either end.")

    @property
    def enabled(self) -> bool:
        """Whether the model's projections take adapters at all."""
        return bool(self.adapters) or self.runtime_updates

    @property
    def num_slots(self) -> int:
        return max(self.max_loras, len(self.adapters), int(self.runtime_updates))

    def rank_cap(self, startup_ranks: list[int]) -> int:
        """The rank each slot holds: ``max_lora_rank``, else the startup adapters' largest (and
        at least 16 when adapters may be loaded later, as vLLM's default)."""
        if self.max_lora_rank:
            return self.max_lora_rank
        return max([*startup_ranks, 16 if self.runtime_updates else 1])


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one engine over ``tensor_parallel_size`` ranks (``distributed/``).
    Rank 0 lives in the engine process; the others are spawned worker processes."""

    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"  # "auto": nccl on CUDA, gloo on the CPU
    # Seconds a rank may take to start (join, load its shard) or to answer one collective
    # before the engine fails with the rank named.
    worker_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}."
            )
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(
                f"distributed_backend: expected one of {', '.join(DISTRIBUTED_BACKENDS)}, got "
                f"{self.distributed_backend!r}."
            )
        if not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be positive seconds, got {self.worker_timeout}.")

    def backend(self, device: torch.device) -> str:
        if self.distributed_backend != "auto":
            return self.distributed_backend
        return "nccl" if device.type == "cuda" else "gloo"


SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's option names (``--speculative-config '<JSON>'``).

    A proposer guesses up to ``num_speculative_tokens`` next tokens of a decoding request; one
    step verifies them all (logits at each of the 1 + k positions) and keeps the longest run
    the target model agrees with, plus one token of its own."""

    method: str = "ngram"  # "ngram" | "suffix" | "draft_model"
    num_speculative_tokens: int = 4
    # ngram: the longest / shortest suffix n-gram looked up in the request's own tokens
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # No proposals in steps with more running requests than this: a large batch is no longer
    # bound by reading the weights, so verifying rejected tokens costs real compute there.
    disable_by_batch_size: int = 32
    # suffix: tree depth (the longest pattern matched), how many finished requests the global
    # tree remembers, proposal length cap as a multiple of the matched length, and the lowest
    # frequency-estimated probability a proposed token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None  # draft_model: the draft's path or configs/ name

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"{where}.method: unknown method {self.method!r}; expected one of "
                f"{', '.join(SPEC_METHODS)}."
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                f"{where}.model: the draft model's path or configs/ name, given with "
                "method 'draft_model' and only with it."
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"{where}.num_speculative_tokens must be in [1, 32], got "
                f"{self.num_speculative_tokens}."
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"{where}.prompt_lookup_min/prompt_lookup_max: need 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"{where}.disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}."
            )
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                f"{where}.suffix_decoding_max_tree_depth must be >= 1 and "
                "suffix_decoding_max_cached_requests >= 0."
            )
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(
                f"{where}.suffix_decoding_max_spec_factor must be > 0 and "
                "suffix_decoding_min_token_prob in [0, 1]."
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """A JSON object's keys and values; an unknown key or a wrong type raises ValueError
        naming it."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        types = {"str": str, "int": int, "float": (int, float), "str | None": (str, type(None))}
        for key, value in values.items():
            if key not in known:
                raise ValueError(
                    f"speculative_config: unknown key {key!r}; known keys: {', '.join(known)}."
                )
            want = types[str(known[key].type)]
            if isinstance(value, bool) or not isinstance(value, want):
                raise ValueError(
                    f"speculative_config.{key}: expected {known[key].type}, got {value!r}."
                )
        return cls(**values)

# -- the kernels' switches ------------------------------------------------------------------------
# Each field's metadata holds its one-line description ("doc") and, where one seeds its default,
# the environment variable ("env"); ``--kernel-config``'s help and the README's table read them.


def _switch(env: envs.EnvBool | envs.EnvInt, doc: str, invert: bool = False) -> Any:
    """A field whose default an environment variable seeds, read when a config is built."""
    if invert:
        return field(default_factory=lambda: not env.get(), metadata={"doc": doc, "env": env.name})
    return field(default_factory=env.get, metadata={"doc": doc, "env": env.name})


def _knob(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


def parse_gemv_launch(text: str | None) -> dict[str, tuple[int, int, int]]:
    """``"bf16=4,2048,4;fp8=4,1024,4"`` -> ``{"bf16": (4, 2048, 4), "fp8": (4, 1024, 4)}``."""
    out: dict[str, tuple[int, int, int]] = {}
    for item in filter(None, (text or "").split(";")):
        kind, _, vals = item.partition("=")
        try:
            out[kind.strip()] = tuple(int(v) for v in vals.split(","))  # type: ignore[assignment]
        except ValueError:
            raise ValueError(
                f"gemv launch table: expected 'kind=block_n,block_k,num_warps;...', got {text!r}."
            ) from None
    return out


_SPLITS_CAP = 32  # kernels/decode_attention.py MAX_SPLITS: its reduce kernel's tile


@dataclass(frozen=True)
class PdlConfig:
    """Programmatic dependent launch of fulcrum's Triton kernels (Hopper and later, see
    ``kernels/pdl.py``). Read at each launch: a CUDA graph keeps the launches it captured."""

    enabled: bool = _switch(envs.FULCRUM_PDL, "Launch Triton kernels with PDL (Hopper+).")
    pre_release: bool = _switch(
        envs.FULCRUM_PDL_PRE,
        "Grids that release the next kernel early do it before their wait, not after it.",
    )
    early_max_waves: int = _knob(
        1, "Grids of up to this many SM counts release the next kernel early."
    )


@dataclass(frozen=True)
class GemvConfig:
    """The few-row linear-layer kernel (``kernels/gemv.py``) and what its epilogue fuses."""

    max_m: int = _switch(
        envs.FULCRUM_GEMV_MAX_M,
        "Linear layers of up to this many rows run the Triton GEMV on CUDA (0: cuBLAS always).",
    )
    fuse_silu: bool = _switch(
        envs.FULCRUM_GEMV_SILU, "SiLU-and-mul in the one-row gate_up GEMV's epilogue."
    )
    fuse_rope: bool = _switch(
        envs.FULCRUM_GEMV_ROPE, "Rotary and the K/V write in the one-row qkv GEMV's epilogue."
    )
    int_one_row: bool = _knob(
        True,
        "One row of an INT4/INT8 (GPTQ, AWQ, GGUF) layer runs the one-row W4A16 GEMV, which "
        "takes each group's scale and zero out of its sums; off: the kernel that dequantizes "
        "each weight.",
    )
    fp8_words: bool = _knob(
        True,
        "One row of an FP8 (e4m3) weight is read as 32-bit words of four weights and widened "
        "a pair per conversion instruction (CUDA); off: Triton's byte-by-byte widening.",
    )
    launch: dict[str, tuple[int, int, int]] = field(
        default_factory=lambda: parse_gemv_launch(envs.FULCRUM_GEMV_CONFIG.get()),
        hash=False,
        metadata={
            "doc": "(block_n, block_k, num_warps) per weight kind (bf16, bf16_small, fp8, "
            "fp8_words, fp32) "
            "replacing the tuned launch table.",
            "env": envs.FULCRUM_GEMV_CONFIG.name,
        },
    )

    def __post_init__(self) -> None:
        if self.max_m < 0:
            raise ValueError(f"kernel_config.gemv.max_m must be >= 0, got {self.max_m}.")
        launch = {}
        for kind, vals in dict(self.launch).items():
            vals = tuple(int(v) for v in vals)
            if len(vals) != 3 or min(vals) < 1:
                raise ValueError(
                    f"kernel_config.gemv.launch[{kind!r}]: expected (block_n, block_k, "
                    f"num_warps), got {vals}."
                )
            launch[kind] = vals
        object.__setattr__(self, "launch", launch)


@dataclass(frozen=True)
class AttentionKernelConfig:
    """The Triton attention backend and its split-KV decode kernel."""

    fuse_rope_kv: bool = _knob(True, "Rotary and the K/V cache write in one kernel.")
    fuse_qk_norm: bool = _knob(
        True, "Per-head RMSNorms of q and k (Qwen3) in that rotary kernel, not two launches."
    )
    order_min_reqs: int = _knob(
        64, "From this many decode requests, run them longest context first."
    )
    max_splits: int = _knob(
        _SPLITS_CAP, f"Most splits of one request's context in decode attention (1..{_SPLITS_CAP})."
    )
    min_split_tokens: int = _knob(0, "A decode split takes at least this many tokens (CUDA).")
    pre_wait_max_reqs: int = _knob(
        4, "Up to this many requests, decode splits read their inputs before the PDL wait."
    )
    split_early: bool = _knob(
        True, "Up to pre_wait_max_reqs requests, a 16-bit cache's splits release the reduce early."
    )
    combine_max_reqs: int = _knob(
        0, "Up to this many requests, the last decode split of a head group combines the splits (no reduce launch)."
    )

    def __post_init__(self) -> None:
        if not 1 <= self.max_splits <= _SPLITS_CAP:
            raise ValueError(
                f"kernel_config.attention.max_splits must be in [1, {_SPLITS_CAP}], got "
                f"{self.max_splits}."
            )


@dataclass(frozen=True)
class IntGemmConfig:
    """INT4/INT8 weight-only layers (GPTQ, AWQ, GGUF legacy parts) at more rows than the GEMV
    takes (``kernels/w4a16.py``)."""

    swap_ab: bool = _knob(
        False,
        "The W4A16 GEMM computes out^T = W^T x^T, the weight dequantized in registers as the "
        "MMA's first operand (on Hopper no shared-memory round trip for it). Off: slower than "
        "the default operand order where measured (BENCHMARKS §9.2).",
    )
    dense_rows: int = _knob(
        256,
        "From this many rows a layer dequantizes its weight and runs the dense GEMM (cuBLAS), "
        "which repays writing the weight once where the GEMM is compute-bound; 0: never. 256: "
        "below it the W4A16 GEMM won or tied on the widest layers, above it the dense path won "
        "on every 8B and 70B linear measured (BENCHMARKS §9.2).",
    )

    def __post_init__(self) -> None:
        if self.dense_rows < 0:
            raise ValueError(
                f"kernel_config.int_gemm.dense_rows must be >= 0, got {self.dense_rows}."
            )


@dataclass(frozen=True)
class KernelConfig:
    """Which fast paths the engine takes and how its Triton kernels launch. Every field is a
    speed decision: outputs are the same either way (to the dtype's rounding)."""

    triton_kernels: bool = _switch(
        envs.FULCRUM_DISABLE_TRITON_KERNELS,
        "Run fulcrum's Triton kernels on CUDA tensors (off: the torch versions).",
        invert=True,
    )
    pdl: PdlConfig = _section(PdlConfig, "Programmatic dependent launch.")
    gemv: GemvConfig = _section(GemvConfig, "The few-row linear-layer kernel.")
    attention: AttentionKernelConfig = _section(AttentionKernelConfig, "Triton attention.")
    int_gemm: IntGemmConfig = _section(IntGemmConfig, "INT4/INT8 weight-only layers' GEMM.")
    rmsnorm_weight_first: bool = _knob(
        True, "RMSNorm loads its weight before the PDL wait (it is never written in a step)."
    )
    argmax_kernel: bool = _switch(
        envs.FULCRUM_ARGMAX_KERNEL, "Greedy rows' argmax in one Triton launch (CUDA)."
    )
    fused_sampler: bool = _switch(
        envs.FULCRUM_FUSED_SAMPLER,
        "Sampled rows without penalties or logprobs take the sort-free kernels (CUDA).",
    )
    graph_patch: bool = _switch(
        envs.FULCRUM_GRAPH_PATCH,
        "Decode graphs patch in the previous step's sampled ids as their first kernel.",
    )
    sample_in_graph: bool = _switch(
        envs.FULCRUM_SAMPLE_IN_GRAPH,
        "Decode graphs end with the sort-free sampler (with fused_sampler), so a sampled decode "
        "step launches nothing between replays.",
    )
    capture_warmup: bool = _switch(
        envs.FULCRUM_CAPTURE_WARMUP,
        "Run every decode graph's step eagerly before capturing it, even after the dry run.",
    )
    compile_ahead: bool = _switch(
        envs.FULCRUM_COMPILE_AHEAD,
        "Compile the Triton kernels of start-up's passes in parallel, ahead of running them.",
    )
    fused_moe: bool = _switch(
        envs.FULCRUM_FUSED_MOE,
        "Mixture-of-experts layers run the fused Triton routing and grouped GEMMs (CUDA).",
    )
    moe_fp8_act_rows: int = _knob(
        4,
        "FP8 experts quantize their activations per row and multiply on FP8 tensor cores from "
        "this many (token, expert) rows per expert on average; below it (single-stream decode) "
        "the weights are widened in registers and the activations stay in the model's dtype. "
        "0: never. The lowest row count measured faster than widening (BENCHMARKS §9.1).",
    )
    fuse_fp8_quant: bool = _knob(
        True,
        "FP8 layers' GEMM steps take their input rows quantized by the kernel before them: the "
        "RMSNorm (with its residual add) and SiLU-and-mul write e4m3 rows and their scales "
        "instead of bf16 rows that a separate per-token quantization reads again (the faster "
        "of the two in BENCHMARKS §2).",
    )
    cpu_packed_linear: bool = _knob(
        True,
        "Float32 linear layers on the CPU use a oneDNN-packed copy of their weights for the row "
        "counts where a start-up measurement finds it faster than F.linear (one row, 256 rows), "
        "and with speculative decoding for steps of 2 to 64 rows (verify steps); where it serves "
        "every row count the original weight is dropped, else the weights take twice the memory.",
    )
    cpu_primitive_cache: int = _knob(
        64,
        "Entries of oneDNN's primitive cache and PyTorch's ideep cache in a CPU engine's process "
        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY, where the environment does not "
        "set them; the libraries' own default is 1,024). Both keep one entry per input shape, "
        "and a serving engine meets a new row count at almost every mixed step: at 1,024 its "
        "memory kept growing under sustained traffic (BENCHMARKS §12). 0: no cache.",
    )

    def __post_init__(self) -> None:
        if self.cpu_primitive_cache < 0:
            raise ValueError(
                f"kernel_config.cpu_primitive_cache must be >= 0, got {self.cpu_primitive_cache}."
            )
        if self.moe_fp8_act_rows < 0:
            raise ValueError(
                f"kernel_config.moe_fp8_act_rows must be >= 0, got {self.moe_fp8_act_rows}."
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], prefix: str = "") -> KernelConfig:
        """A config from (nested) JSON-style values; an unknown key raises ValueError naming
        it. Unnamed fields keep their defaults."""
        return _from_dict(cls, values, prefix)

    def replace(self, **changes: Any) -> KernelConfig:
        """A copy with ``changes``: nested sections as dicts merge into the current ones
        (``replace(pdl={"enabled": False})`` keeps ``pdl.pre_release``)."""
        merged = dataclasses.asdict(self)
        for key, value in changes.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            elif dataclasses.is_dataclass(value):
                merged[key] = dataclasses.asdict(value)  # type: ignore[arg-type]
            else:
                merged[key] = value
        return _from_dict(type(self), merged, "")


def _from_dict(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(values, Mapping):
        where = f"kernel_config.{prefix}" if prefix else "kernel_config"
        raise ValueError(f"{where}: expected an object, got {values!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        f = fields.get(key)
        if f is None:
            raise ValueError(
                f"kernel_config: unknown key {prefix + '.' + key if prefix else key!r}; "
                f"expected one of {', '.join(fields)}."
            )
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            value = _from_dict(sub, value, f"{prefix}.{key}" if prefix else key)
        elif f.type in ("bool", "int") and (
            not isinstance(value, int) or isinstance(value, bool) != (f.type == "bool")
        ):
            name = f"{prefix}.{key}" if prefix else key
            raise ValueError(f"kernel_config.{name}: expected {f.type}, got {value!r}.")
        kwargs[key] = value
    return cls(**kwargs)


def describe_kernel_config(
    cls: type = KernelConfig, prefix: str = ""
) -> Iterator[tuple[str, Any, str, str | None]]:
    """``(dotted name, default, description, seeding env var)`` for every switch."""
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            yield from describe_kernel_config(type(value), prefix + f.name + ".")
        else:
            yield prefix + f.name, value, f.metadata.get("doc", ""), f.metadata.get("env")


@dataclass(frozen=True)
class EngineConfig:
    """The resolved engine. Built by ``EngineArgs.create_engine_config``, which holds the
    user-facing defaults; the fields below are the decisions it resolved (eager on the CPU,
    ``auto`` scheduling by device, ...), so they carry no defaults of their own."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    attention_backend: str  # "torch" | "triton" | "auto"
    enforce_eager: bool
    async_scheduling: bool  # schedule step N+1 before step N's tokens are back
    piecewise_graph_max_tokens: int  # prefill/mixed steps up to this many tokens: graphs
    kernel_config: KernelConfig  # the kernels' fast paths and launch settings
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    draft_model_config: ModelConfig | None = None  # speculative_config.method "draft_model"
    parallel_config: ParallelConfig = ParallelConfig()  # tensor parallelism (1: one device)
    lora_config: LoRAConfig = LoRAConfig()  # no adapters: the base model only
