"""GPTQ and AWQ checkpoints under tensor parallelism (``distributed/packed_shards.py``,
``quant/int_regroup.py``): each rank's slices of a layer dequantize to exactly that layer's
slice of the reference weight (act-order row slices regrouped, also through the W4A16 kernels in
the interpreter); greedy tokens at tp=2 (gloo, two ranks) equal tp=1 on the same checkpoint and
transformers on its dequantized weights; slices that would split a word or a group are refused
at start-up with the numbers."""

from __future__ import annotations

import pytest
import torch

from fulcrum import LLM, SamplingParams
from fulcrum.distributed.sharding import ShardSpec
from fulcrum.kernels import w4a16, w4a16_gemv
from fulcrum.quant import get_quant_method
from fulcrum.quant.int4 import IntLinear
from int_quantizer import checkpoint_maker, dequantize_reference, quantize_linear, with_config
from model_factory import hf_greedy

# (method, bits, group_size, sym, desc_act)
FORMATS = {
    "gptq4_g32_sym": ("gptq", 4, 32, True, False),
    "gptq4_g32_asym": ("gptq", 4, 32, False, False),
    "gptq4_g32_asym_actorder": ("gptq", 4, 32, False, True),
    "gptq8_g16_asym_actorder": ("gptq", 8, 16, False, True),
    "gptq8_gall_sym": ("gptq", 8, -1, True, False),
    "gptq4_gall_actorder": ("gptq", 4, -1, False, True),
    "awq4_g32": ("awq", 4, 32, False, False),
}
PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(20, 45)), [4] * 5 + list(range(100, 120))]
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory=0.01, max_num_batched_tokens=16)
# the tiny models' shapes (tests/model_factory.py): 4 heads of 16, 2 KV heads, MLP 128
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=320)


def _layer(fmt: str, spec: ShardSpec, name: str, tensors, in_f: int, out_f: int, row: bool):
    """One rank's layer of projection ``name``, loaded from its slices of the full tensors."""
    method, bits, gs, sym, act = FORMATS[fmt]
    qc = {"quant_method": method, "bits": bits, "group_size": gs, "sym": sym, "desc_act": act}
    lin = get_quant_method(method, qc).linear(in_f, out_f, bias=False)
    assert isinstance(lin, IntLinear)
    if row:
        lin.shard_input(spec.world)
    lin.check_format(name)
    for leaf, t in tensors.items():
        assert lin.load_packed(leaf, spec(f"{name}.{leaf}", t), None)
    lin.finish_loading()
    return lin


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rank_slices_equal_the_layers_slices(fmt: str) -> None:
    """Column-parallel k_proj, fused qkv_proj (Phi-3's checkpoints) and row-parallel down_proj
    on each of two ranks: the dequantized weight is exactly the reference's slice, and a
    row slice's product (CPU path, and the kernels reading its regrouped layout) is x times it."""
    method, bits, gs, sym, act = FORMATS[fmt]
    gen = torch.Generator().manual_seed(7)
    w_qkv = torch.randn(128, 64, generator=gen) * 0.1  # q 64, k 32, v 32 rows
    w_down = torch.randn(64, 128, generator=gen) * 0.1
    qkv = quantize_linear(w_qkv, method, bits, gs, sym, act, torch.Generator().manual_seed(1))
    k = quantize_linear(w_qkv[64:96], method, bits, gs, sym, act, torch.Generator().manual_seed(1))
    down = quantize_linear(w_down, method, bits, gs, sym, act, torch.Generator().manual_seed(2))
    ref_qkv, ref_k, ref_down = (dequantize_reference(t, method, bits, gs) for t in (qkv, k, down))
    x_full = torch.randn(3, 128, generator=gen)  # down_proj's input: each rank holds half
    partial = []
    for rank in (0, 1):
        spec = ShardSpec(rank, 2, **SHAPE, packed=get_quant_method(method, {
            "quant_method": method, "bits": bits, "group_size": gs, "sym": sym, "desc_act": act,
        }).format)  # fmt: skip
        lin = _layer(fmt, spec, "model.layers.0.self_attn.k_proj", k, 64, 16, row=False)
        assert torch.equal(lin.dequantized_weight(), ref_k[rank * 16 : rank * 16 + 16])
        lin = _layer(fmt, spec, "model.layers.0.self_attn.qkv_proj", qkv, 64, 64, row=False)
        rows = [(rank * 32, 32), (64 + rank * 16, 16), (96 + rank * 16, 16)]
        want = torch.cat([ref_qkv[s : s + n] for s, n in rows])
        assert torch.equal(lin.dequantized_weight(), want)
        lin = _layer(fmt, spec, "model.layers.0.mlp.down_proj", down, 64, 64, row=True)
        want = ref_down[:, rank * 64 : rank * 64 + 64]
        assert torch.equal(lin.dequantized_weight(), want)
        assert lin.all_groups == (act and gs != -1)
        if lin.all_groups:  # regrouped, padded by less than the whole layer's rows
            assert lin.perm is not None and 64 <= lin.perm.numel() < 128
        x = x_full[:, rank * 64 : rank * 64 + 64].contiguous()
        y = lin(x)
        torch.testing.assert_close(y, x @ want.t(), rtol=0, atol=0)
        xp = x if lin.perm is None else x.index_select(1, lin.perm)
        ops = (xp, lin.qweight, lin.zeros, lin.scales, None, lin.group, bits)
        for kernel in (w4a16_gemv.gemv, w4a16.gemm):
            torch.testing.assert_close(kernel(*ops), y, rtol=1e-5, atol=1e-5)
        partial.append(y)
    torch.testing.assert_close(partial[0] + partial[1], x_full @ ref_down.t())


def test_regroup_pads_each_group_to_whole_chunks() -> None:
    """Rows of groups 3 0 3 1 0 3 at 8 bits (4 a word, group 4): sorted by group, padded to
    chunks of 4 with weight-0 rows (q = the zero point), one zero/scale row a chunk; a zero
    point that no value of the width can hold is refused."""
    from fulcrum.quant.int_regroup import regroup

    g_idx = torch.tensor([3, 0, 3, 1, 0, 3])
    q = torch.tensor([[10], [11], [12], [13], [14], [15]], dtype=torch.int32)
    zeros = torch.tensor([[1], [2], [3], [4]], dtype=torch.int32)
    scales = torch.tensor([[1.0], [2.0], [3.0], [4.0]]).half()
    out, z, s, perm, chunk = regroup(q, zeros, scales, g_idx, 8, 4, "layer")
    assert chunk == 4 and out.flatten().tolist() == [11, 14, 1, 1, 13, 2, 2, 2, 10, 12, 15, 4]
    assert perm.tolist() == [1, 4, 0, 0, 3, 0, 0, 0, 0, 2, 5, 0]
    assert z.flatten().tolist() == [1, 2, 4] and s.flatten().tolist() == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="layer: a zero point of 16 does not fit 4 bits"):
        regroup(q, zeros * 4, scales, g_idx, 4, 4, "layer")


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """(arch, format) -> (checkpoint dir, dequantized reference dir), written on first use."""
    return checkpoint_maker(tiny_models, tmp_path_factory.mktemp("tp_int4"), FORMATS, seed=5)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "arch,fmt",
    [("llama", "gptq4_g32_sym"), ("llama", "gptq4_g32_asym_actorder"),
     ("qwen2", "gptq4_g32_asym"), ("qwen2", "awq4_g32")],
)  # fmt: skip
def test_tp2_greedy_equals_tp1(quantized, arch: str, fmt: str) -> None:
    """Sharded GQA heads, the MLP and (qwen2) the qkv bias; prompts longer than the step budget
    run as chunked prefill. Act-order: each rank's o_proj/down_proj rows regrouped."""
    dst, ref = quantized(arch, fmt)
    one = _greedy(LLM(dst, **ENGINE))
    llm = LLM(dst, tensor_parallel_size=2, **ENGINE)
    try:
        down = llm.core.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down, IntLinear) and down.in_features == 64
        assert down.all_groups == FORMATS[fmt][4]
        assert _greedy(llm) == one == hf_greedy(ref, PROMPTS, 8)
    finally:
        llm.core.shutdown()


@pytest.mark.parametrize(
    "fmt,quant,model,match",
    [
        ("gptq4_g32_sym", {"group_size": 64}, {},
         r"tensor_parallel_size=2: model\.layers\.\*\.self_attn\.o_proj's 64 input features "
         r"split into 32 per rank, not a multiple of quantization_config\.group_size 64"),
        ("awq4_g32", {}, {"intermediate_size": 136},
         r"tensor_parallel_size=2: model\.layers\.\*\.mlp\.gate_proj splits into 68 output "
         r"features per rank, not a multiple of the 8 that awq packs in one word"),
        ("gptq8_gall_sym", {}, {"intermediate_size": 132},
         r"model\.layers\.\*\.mlp\.gate_proj splits into 66 output features per rank, not a "
         r"multiple of the 4 that gptq packs"),
    ],
)  # fmt: skip
def test_slices_off_word_or_group_refused(quantized, tmp_path, fmt, quant, model, match) -> None:
    """Refused at start-up from config.json alone, before any rank starts."""
    dst, _ = quantized("llama", fmt)
    bad = with_config(dst, str(tmp_path / "bad"), quant, **model)
    with pytest.raises(ValueError, match=match):
        LLM(bad, tensor_parallel_size=2, **ENGINE)
