"""GGUF blocks kept packed under tensor parallelism (``distributed/gguf_shards.py``): each rank's
slice of a projection's blocks repacks into exactly that slice of the whole tensor's kernel
layout (every packed type, both split directions, llama.cpp's Q/K row order undone per rank);
greedy tokens at tp=2 (gloo, two ranks) equal tp=1 on tiny Llamas whose fused q/k/v and
gate/up mix types, and on a Qwen2 with biases and an untied head; a rank's input slice that would split a block is refused at start-up with
the layer, its type and the numbers."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.distributed.gguf_shards import check_gguf_shards
from fulcrum.distributed.sharding import ShardSpec
from fulcrum.model.loader.gguf_loader import iter_gguf_packed
from fulcrum.quant.gguf import GgufBlocks, GgufLinear
from gguf_kquant_writer import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, write_tiny_llama

# (layer, projection) -> type, and each fused layer's parts. The files' hidden size is 256, so
# at tp=2 a rank's o_proj holds 128 inputs: whole blocks of 32 (Q4_0/Q4_1/Q8_0), not of a
# K-quant's 256, which the "kmix" file uses everywhere else.
FILES = {
    "legacy": (
        {(0, "attn_q"): "Q4_0", (0, "attn_k"): "Q4_1", (0, "attn_v"): "Q8_0",
         (0, "attn_output"): "Q4_1", (0, "ffn_gate"): "Q8_0", (0, "ffn_up"): "Q4_0",
         (0, "ffn_down"): "Q4_1", (1, "attn_q"): "Q8_0", (1, "attn_k"): "Q8_0",
         (1, "attn_v"): "Q4_0", (1, "attn_output"): "Q4_0", (1, "ffn_gate"): "Q4_1",
         (1, "ffn_up"): "Q4_1", (1, "ffn_down"): "Q8_0"},
        {(0, "qkv_proj"): ["Q4_0", "Q4_1", "Q8_0"], (0, "gate_up_proj"): ["Q8_0", "Q4_0"],
         (1, "qkv_proj"): ["Q8_0", "Q4_0"], (1, "gate_up_proj"): ["Q4_1"]},
    ),
    "kmix": (  # unnamed projections: Q4_K
        {(0, "attn_v"): "Q6_K", (0, "attn_output"): "Q8_0", (0, "ffn_up"): "Q5_K",
         (0, "ffn_down"): "Q6_K", (1, "attn_q"): "Q5_K", (1, "attn_k"): "Q6_K",
         (1, "attn_v"): "Q6_K", (1, "attn_output"): "Q4_0", (1, "ffn_gate"): "Q5_K",
         (1, "ffn_up"): "Q5_K"},
        {(0, "qkv_proj"): ["Q4_K", "Q6_K"], (0, "gate_up_proj"): ["Q4_K", "Q5_K"],
         (1, "qkv_proj"): ["Q5_K", "Q6_K"], (1, "gate_up_proj"): ["Q5_K"]},
    ),
}  # fmt: skip
FUSED = {"qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
         "gate_up_proj": ("mlp", ["gate_proj", "up_proj"])}  # fmt: skip
HF = types.SimpleNamespace(
    model_type="llama", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS
)
PROMPTS = [[1, 504, 3458, 314, 216], list(range(40, 62))]
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory=0.01, max_num_batched_tokens=16,
              max_model_len=256)  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """name -> path: FILES, and "q4k" (every projection Q4_K); their metadata (config,
    tokenizer) cached in a private directory."""
    root = tmp_path_factory.mktemp("tp_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FULCRUM_CACHE_DIR", str(root / "cache"))
        kinds = {name: t for name, (t, _) in FILES.items()} | {"q4k": {}}
        out = {name: str(root / f"{name}.gguf") for name in [*kinds, "qwen2"]}
        for seed, (name, t) in enumerate(kinds.items()):
            write_tiny_llama(out[name], t, seed=seed)
        write_tiny_llama(out["qwen2"], FILES["legacy"][0], seed=7, arch="qwen2", untied=True)
        yield out


def _spec(rank: int, world: int) -> ShardSpec:
    return ShardSpec(rank, world, HEADS, KV_HEADS, HIDDEN // HEADS, INTER, VOCAB)


def _layer(shards: list[tuple[GgufBlocks, tuple[int, int]]]) -> GgufLinear:
    lin = GgufLinear(shards[0][0].k, sum(b.n for b, _ in shards), bias=False)
    for blocks, offset in shards:
        assert lin.load_packed("blocks", blocks, offset)
    lin.finish_loading()
    return lin


def _slice(p: torch.Tensor, dim: int, start: int, size: int, k: int) -> torch.Tensor:
    """Output features ``[start, start + size)`` (columns) or inputs of ``k`` (rows) of a tensor
    in the kernels' layout, whose rows run along the inputs in proportion."""
    if dim == 0:
        return p[:, start : start + size]
    rows = p.shape[0]
    return p[start * rows // k : (start + size) * rows // k]


@pytest.mark.parametrize("name,world", [("legacy", 2), ("legacy", 4), ("kmix", 2)])
def test_rank_blocks_equal_the_whole_layers_slices(
    files: dict[str, str], name: str, world: int
) -> None:
    """Every projection on every rank: each tensor of the kernels' layout is the whole tensor's
    columns (q/k/v, gate/up; at tp=4 two ranks share each KV head) or rows (o_proj, down_proj),
    exactly. Each rank's fused layers keep one part per type and dequantize to the whole
    layers' rows; its vocabulary rows are the table's."""
    whole = dict(iter_gguf_packed(files[name], HF))
    full = {n: _layer([(b, (0, b.n))]) for n, b in whole.items() if n.endswith(".blocks")}
    for rank in range(world):
        spec = _spec(rank, world)
        mine = dict(iter_gguf_packed(files[name], HF, spec))
        for proj, lin in full.items():
            dim, (start, size) = spec.rule(proj.replace(".blocks", ".weight"))
            part = _layer([(mine[proj], (0, mine[proj].n))]).parts[0]
            for (leaf, p), q in zip(
                lin.parts[0].named_parameters(), part.parameters(), strict=True
            ):
                assert torch.equal(q, _slice(p, dim, start, size, lin.in_features)), (proj, leaf)
        vocab = VOCAB // world
        table = whole["model.embed_tokens.weight"][rank * vocab : (rank + 1) * vocab]
        assert torch.equal(mine["model.embed_tokens.weight"], table)
        for (i, fused), kinds in FILES[name][1].items():
            sub, parts = FUSED[fused]
            pre = f"model.layers.{i}.{sub}."
            blocks = [mine[f"{pre}{p}.blocks"] for p in parts]
            lin = _layer([(b, (sum(c.n for c in blocks[:j]), b.n)) for j, b in enumerate(blocks)])
            assert [p.type_name for p in lin.parts] == kinds
            want = []
            for p in parts:
                _, (start, size) = spec.rule(f"{pre}{p}.weight")
                want.append(full[f"{pre}{p}.blocks"].dequantized_weight()[start : start + size])
            assert torch.equal(lin.dequantized_weight(), torch.cat(want))


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.parametrize("name", list(FILES))
def test_tp2_greedy_equals_tp1(files: dict[str, str], name: str) -> None:
    """Packed at tp=2 as at tp=1 (the second prompt runs as chunked prefill); the legacy file
    also dequantized at load at tp=2 (the converted checkpoint sliced as safetensors are)."""
    one = _greedy(LLM(files[name], quantization="gguf", **ENGINE))
    assert all(len(set(t)) > 3 for t in one)  # the random model does not repeat one token
    llm = LLM(files[name], quantization="gguf", tensor_parallel_size=2, **ENGINE)
    try:
        layer = llm.core.runner.model.model.layers[0]
        down = layer.mlp.down_proj
        assert isinstance(down, GgufLinear) and down.in_features == INTER // 2
        kinds = [p.type_name for p in layer.self_attn.qkv_proj.parts]
        assert kinds == FILES[name][1][0, "qkv_proj"]
        assert _greedy(llm) == one
    finally:
        llm.core.shutdown()
    if name == "legacy":
        llm = LLM(files[name], tensor_parallel_size=2, **ENGINE)
        try:
            assert _greedy(llm) == one
        finally:
            llm.core.shutdown()


def test_tp2_qwen2_biases_and_untied_head(files: dict[str, str]) -> None:
    """A Qwen2 file (q/k/v biases, its own Q8_0 ``output.weight``), packed at tp=2: each rank
    holds its heads' bias rows and its vocabulary rows of the head, and greedy tokens equal
    tp=1's, which equal transformers' on the file's dequantized weights."""
    from fulcrum.model.loader.gguf_loader import convert_gguf
    from model_factory import hf_greedy

    one = _greedy(LLM(files["qwen2"], quantization="gguf", **ENGINE))
    assert all(len(set(t)) > 3 for t in one)
    assert one == hf_greedy(convert_gguf(files["qwen2"]), PROMPTS, 6)
    llm = LLM(files["qwen2"], quantization="gguf", tensor_parallel_size=2, **ENGINE)
    try:
        model = llm.core.runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.bias is not None and qkv.bias.shape[0] == qkv.out_features
        assert qkv.bias.abs().min() > 0  # the file's biases, not a zero fill
        head = model.lm_head
        if head.weight is None:  # dropped for its oneDNN-packed copy: only an untied head is
            assert head.packed is not None
        else:
            assert head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert _greedy(llm) == one
    finally:
        llm.core.shutdown()


def test_input_slice_off_a_block_refused(files: dict[str, str]) -> None:
    """At start-up, from the file's tensor types, before any rank starts; a rank's own slicing
    refuses it too."""
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2: model\.layers\.0\.self_attn"
                       r"\.o_proj \(Q4_K\) has 256 input features, split into 128 per rank, not "
                       r"a multiple of the 256 values of a Q4_K block\.$"):  # fmt: skip
        LLM(files["q4k"], quantization="gguf", tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match=r"^rank 1: model\.layers\.0\.mlp\.down_proj \(Q6_K\) "
                       r"has 512 input features, split into 128 per rank"):  # fmt: skip
        list(iter_gguf_packed(files["kmix"], HF, _spec(1, 4)))
    down = [("model.layers.4.mlp.down_proj.weight", "Q8_0", 288)]  # 9 blocks of 32
    check_gguf_shards(ShardSpec(0, 3, 6, 6, 16, 288, 100), down, "tp")  # 3 blocks a rank
    with pytest.raises(ValueError, match=r"^tp: model\.layers\.4\.mlp\.down_proj \(Q8_0\) has "
                       r"288 input features, split into 144 per rank, not a multiple of the 32 "
                       r"values of a Q8_0 block\.$"):  # fmt: skip
        check_gguf_shards(ShardSpec(0, 2, 6, 6, 16, 288, 100), down, "tp")
