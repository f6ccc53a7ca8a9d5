"""LoRA adapters (PEFT checkpoints made here by PEFT itself on the tiny Llama): greedy tokens equal
PEFT's own model on the CPU in float32, with base-model rows and two adapters (every projection,
and q/v only with rsLoRA scaling) in one batch, chunked prefill beside decodes, asynchronous
scheduling, and prefix-cache entries never shared between an adapter and the base model; bad
adapters and names are refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fulcrum import LLM, SamplingParams
from spec_helpers import spec_prompts, toks

MAX_NEW = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def case(tiny_models, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_models["llama"]
    prompts = spec_prompts(5)[:4]
    root = tmp_path_factory.mktemp("lora")
    ref: dict[str | None, list[list[int]]] = {}
    dirs = {}
    for name, targets, extra in [("all", ALL, {}), ("qv", ["q_proj", "v_proj"], {"use_rslora": True})]:
        torch.manual_seed(len(name))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **extra)
        peft = get_peft_model(model, cfg).eval()
        dirs[name] = str(root / name)
        peft.save_pretrained(dirs[name])
        ref[name] = _peft_greedy(peft, prompts)
    ref[None] = _peft_greedy(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), prompts)
    assert ref["all"] != ref[None] and ref["qv"] != ref[None]  # each adapter changes the output
    return base, prompts, dirs, ref


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_adapters_and_base_in_one_batch(case, async_scheduling: str) -> None:
    base, prompts, dirs, ref = case
    llm = LLM(base, device="cpu", dtype="float32", block_size=4, lora_modules=dirs,
              max_num_batched_tokens=24, async_scheduling=async_scheduling)  # fmt: skip
    names = [None, "all", "qv"]
    batch = [(p, n) for p in prompts for n in names]  # the same prompt under each: no sharing
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora=[n for _, n in batch])
    for (p, n), got in zip(batch, toks(outs), strict=True):
        assert got == ref[n][prompts.index(p)], (n, p)
    # again, one adapter for all: the blocks the base model cached serve none of these
    outs = llm.generate(prompts, params, use_tqdm=False, lora="qv")
    assert toks(outs) == ref["qv"]
    assert toks(llm.generate(prompts, params, use_tqdm=False)) == ref[None]


def test_adapter_rows_through_emulated_decode_graphs(case) -> None:
    """Decode steps with adapter rows replay the LoRA decode graphs (each row's adapter read
    through the static slot buffer, padded rows the base model's); base-only steps replay the
    base graphs; a step may switch from one set to the other (the ids the previous replay
    sampled are patched in from the right set, with the patch inside the graphs)."""
    from fulcrum.worker import startup

    base, prompts, dirs, ref = case
    llm = LLM(base, device="cpu", dtype="float32", block_size=4, lora_modules=dirs,
              attention_backend="triton", max_num_seqs=4, async_scheduling="on",
              kernel_config={"graph_patch": True})  # fmt: skip
    runner = llm.core.runner
    startup.capture_graphs(runner, emulate=True)
    assert runner.graphs is not None and runner.lora_graphs is not None
    names = [None, "all", "qv"]
    batch = [(p, n) for p in prompts[:1] for n in names]  # 3 rows: the 4-row bucket, padded
    # the adapters' rows stop first: the last steps switch from the LoRA graphs to the base ones
    # (each decode step runs the Triton attention through the CPU's interpreter: short outputs)
    params = [SamplingParams(temperature=0, max_tokens=7 if n is None else 3,
                             ignore_eos=True) for _, n in batch]  # fmt: skip
    outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora=[n for _, n in batch])
    for (p, n), got, sp in zip(batch, toks(outs), params, strict=True):
        assert got == ref[n][prompts.index(p)][: sp.max_tokens], (n, p)
    assert runner.lora_graphs.num_replays >= 2
    base_replays = runner.graphs.num_replays
    assert base_replays >= 3
    # the base rows alone, then an adapter alone: each set of graphs serves its steps
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert toks(llm.generate(prompts[1:3], short, use_tqdm=False)) == [r[:3] for r in ref[None][1:3]]
    assert runner.graphs.num_replays > base_replays
    got = toks(llm.generate(prompts[1:3], short, use_tqdm=False, lora="all"))
    assert got == [r[:3] for r in ref["all"][1:3]]


def test_bad_adapters_and_names(case, tmp_path) -> None:
    base, prompts, dirs, _ = case
    with pytest.raises(ValueError, match="lora_modules: .* is not a PEFT adapter directory"):
        LLM(base, device="cpu", dtype="float32", lora_modules={"x": str(tmp_path)})
    with pytest.raises(ValueError, match="lora_modules: expected NAME=PATH"):
        LLM(base, device="cpu", dtype="float32", lora_modules=["nopath"])
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.load(open(os.path.join(dirs["qv"], "adapter_config.json")))
    json.dump({**cfg, "use_dora": True}, open(dora / "adapter_config.json", "w"))
    with pytest.raises(ValueError, match="adapter 'd': use_dora=True is not supported"):
        LLM(base, device="cpu", dtype="float32", lora_modules={"d": str(dora)})
    llm = LLM(base, device="cpu", dtype="float32", lora_modules={"qv": dirs["qv"]})
    with pytest.raises(ValueError, match="lora: no adapter named 'nope' \\(served: qv\\)"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False, lora="nope")


def test_adapters_loaded_and_unloaded_while_serving(case) -> None:
    """``allow_runtime_lora_updates``: an adapter loaded into a free slot gives PEFT's tokens; an
    unloaded one finishes the request already running it, keeps its slot until then, and takes
    new requests no more; a name loaded again with other weights never reads the KV cached under
    the old ones; bad loads are refused naming the field."""
    base, prompts, dirs, ref = case
    llm = LLM(base, device="cpu", dtype="float32", block_size=4, max_loras=1,
              allow_runtime_lora_updates=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert toks(llm.generate(prompts, params, use_tqdm=False)) == ref[None]  # every layer wrapped
    llm.load_lora_adapter("x", dirs["all"])
    assert toks(llm.generate(prompts, params, use_tqdm=False, lora="x")) == ref["all"]
    with pytest.raises(ValueError, match="lora_name: an adapter named 'x' is loaded already"):
        llm.load_lora_adapter("x", dirs["qv"])
    with pytest.raises(ValueError, match="max_loras: all 1 adapter slots are in use"):
        llm.load_lora_adapter("y", dirs["qv"])
    # unloaded while a request runs it: that request finishes with it, its slot stays taken
    rid = llm._add({"prompt_token_ids": prompts[0]}, params, lora="x")
    llm.processor.process_outputs(llm.core.step().outputs)
    llm.unload_lora_adapter("x")
    with pytest.raises(ValueError, match="max_loras: all 1 adapter slots are in use"):
        llm.load_lora_adapter("y", dirs["qv"])
    assert toks(llm._run([rid], False, "")) == ref["all"][:1]
    with pytest.raises(ValueError, match="lora: no adapter named 'x' \\(served: none\\)"):
        llm.generate(prompts[:1], params, use_tqdm=False, lora="x")
    with pytest.raises(LookupError, match="lora_name: no adapter named 'x' is loaded"):
        llm.unload_lora_adapter("x")
    # the same name, other weights: the prompts' blocks cached under the first "x" serve none
    llm.load_lora_adapter("x", dirs["qv"])
    assert toks(llm.generate(prompts, params, use_tqdm=False, lora="x")) == ref["qv"]
    llm.unload_lora_adapter("x")
    with pytest.raises(ValueError, match="lora_path: .* is not a PEFT adapter directory"):
        llm.load_lora_adapter("z", base)
    small = LLM(base, device="cpu", dtype="float32", max_lora_rank=2,
                allow_runtime_lora_updates=True)  # fmt: skip
    with pytest.raises(ValueError, match="max_lora_rank: adapter 'z' has rank 4; .* rank 2"):
        small.load_lora_adapter("z", dirs["qv"])
    fixed = LLM(base, device="cpu", dtype="float32", lora_modules={"qv": dirs["qv"]})
    with pytest.raises(ValueError, match="allow_runtime_lora_updates is off"):
        fixed.load_lora_adapter("z", dirs["all"])


def test_adapters_under_tensor_parallelism(case) -> None:
    """Two ranks (gloo): each holds its slice of every adapter (B's output rows of the
    column-parallel projections, A's input columns of the row-parallel ones, whose all-reduce
    then sums the adapter's partial update too); greedy tokens equal PEFT's, for an adapter
    given at start and one loaded while serving (on every rank)."""
    base, prompts, dirs, ref = case
    llm = LLM(base, device="cpu", dtype="float32", tensor_parallel_size=2, kv_cache_memory=0.01,
              lora_modules={"all": dirs["all"]}, max_loras=2,
              allow_runtime_lora_updates=True)  # fmt: skip
    try:
        llm.load_lora_adapter("qv", dirs["qv"])
        names = [None, "all", "qv"]
        batch = [(p, n) for p in prompts[:2] for n in names]
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([p for p, _ in batch], params, use_tqdm=False, lora=[n for _, n in batch])
        for (p, n), got in zip(batch, toks(outs), strict=True):
            assert got == ref[n][prompts.index(p)], (n, p)
    finally:  # this process's tensor-parallel group must go before any later test loads a model
        llm.core.shutdown()
