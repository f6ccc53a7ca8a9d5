"""The decode-graph machinery (buckets, padding rows, static buffers, patched inputs) off CUDA:
replays re-run the captured forward on the same static buffers."""

from __future__ import annotations

import random

import pytest

from fulcrum import LLM, SamplingParams
from fulcrum.worker import startup


def _greedy(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], logprobs: int | None = None
) -> list[list[int]]:
    """Greedy tokens; the first request with ``logprobs`` (the sampler's path, not the argmax
    alone, while it runs)."""
    sps = [
        SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=True, logprobs=logprobs if i == 0 else None
        )
        for i, m in enumerate(max_tokens)
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]


_EAGER: dict[tuple, list[list[int]]] = {}  # eager references shared by a test's parameters


def _eager(model: str, prompts: list[list[int]], max_tokens: list[int], **kw) -> list[list[int]]:
    """Greedy tokens of an eager engine, computed once per module for the same arguments."""
    key = (model, repr(sorted(kw.items())), repr(prompts), repr(max_tokens))
    if key not in _EAGER:
        _EAGER[key] = _greedy(LLM(model, **kw), prompts, max_tokens)
    return _EAGER[key]


@pytest.mark.parametrize("patch_in_graph", [True, False])
def test_emulated_decode_graphs_match_eager(tiny_models, patch_in_graph, monkeypatch):
    """Replays give eager's tokens through shrinking buckets, with the previous step's ids
    patched in by the graph itself or before it, and from the sampler (a request asking for
    logprobs) or the graph's own argmax."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))] for _ in range(7)]
    max_tokens = [2 + i for i in range(7)]  # the batch shrinks through every bucket
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=8)
    want = _eager(tiny_models["llama"], prompts, max_tokens, **kw)
    # The Triton backend (fused rotary + KV write, paged kernels) agrees with the torch one.
    ref_kw = {**kw, "attention_backend": "torch"}
    assert want == _eager(tiny_models["llama"], prompts, max_tokens, **ref_kw)
    kc = {"graph_patch": patch_in_graph}
    llm = LLM(tiny_models["llama"], async_scheduling="on", kernel_config=kc, **kw)
    runner = llm.core.runner
    startup.capture_graphs(runner, emulate=True)
    assert runner.use_cuda_graphs and runner.graphs.sizes == [1, 2, 4, 8]
    assert runner.graphs.patch_in_graph == patch_in_graph
    outside = []  # patches launched between steps (on CUDA: a kernel between two replays)
    fill = runner._fill_sampled
    monkeypatch.setattr(runner, "_fill_sampled", lambda *a: outside.append(1) or fill(*a))
    assert _greedy(llm, prompts, max_tokens) == want
    replays = runner.graphs.num_replays
    assert replays >= max(max_tokens) - 1
    # In the graph, only the first decode step (after the eager prefill) patches outside.
    assert len(outside) == (1 if patch_in_graph else replays)
    assert _greedy(llm, prompts, max_tokens, logprobs=2) == want


def test_profiling_step_runs_on_both_backends(tiny_models):
    """The KV-profiling forward (a block-long prompt plus decode rows against a one-block
    scratch cache, so the prefill kernels compile at start-up) runs on every backend."""
    import torch

    for backend in ("torch", "triton"):
        llm = LLM(
            tiny_models["llama"],
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            max_num_batched_tokens=40,
            num_kv_blocks=16,
        )
        with torch.inference_mode():
            startup.dummy_forward(llm.core.runner, 40)
            startup.dummy_forward(llm.core.runner, 3)
            # with the decode graphs' dry-run steps over a scratch cache (the triton backend)
            startup.compile_pass(llm.core.runner, 40)


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", dict()),
        ("llama", dict(num_kv_blocks=24, block_size=4)),  # preempts requests
        ("gemma2", dict()),  # sliding-window and global layers, soft-capped scores
    ],
)
def test_emulated_piecewise_prefill_graphs_match_eager(tiny_models, arch, extra):
    """Prefill chunks and mixed steps through the token-bucket segment graphs (padding rows,
    attention between segments with each layer's own window and cap, prefix-cache hits,
    recompute after preemption) give eager's tokens."""
    rng = random.Random(6)
    shared = [rng.randrange(3, 320) for _ in range(20)]
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(3, 320) for _ in range(rng.randrange(3, 50))]
        for i in range(6)
    ]
    max_tokens = [2 + i for i in range(6)]  # decode steps run eagerly here: short tails
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=40)  # fmt: skip
    # One eager reference without ``extra``: preempting and recomputing must not change a token.
    want = _eager(tiny_models[arch], prompts, max_tokens, **kw)
    llm = LLM(tiny_models[arch], async_scheduling="on", piecewise_graph_max_tokens=40, **kw,
              **extra)  # fmt: skip
    runner = llm.core.runner
    startup.capture_piecewise(runner, emulate=True)
    pw = runner.piecewise
    assert runner.use_cuda_graphs and pw is not None and pw.sizes == [8, 16, 32, 40]
    assert all(len(g) == 3 for g in pw.graphs.values())  # 2 layers: 3 segments
    assert _greedy(llm, prompts, max_tokens) == want
    assert pw.num_replays >= 6
    if extra:
        assert llm.stats()["num_preemptions_total"] > 0
    llm.core.scheduler.kv.check_integrity()


def test_qwen3_qk_norm_in_the_rotary_kernel_gives_the_same_tokens(tiny_models):
    """Qwen3's per-head q/k norms fused into the Triton backend's rotary kernel
    (``attention.fuse_qk_norm``) against the two norm kernels before it and against the torch
    backend: the same greedy tokens over prefill chunks and decode steps."""
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    max_tokens = [6, 4, 5]
    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24)
    want = _eager(tiny_models["qwen3"], prompts, max_tokens, **kw)
    for fuse in (True, False):
        llm = LLM(tiny_models["qwen3"], attention_backend="triton",
                  kernel_config={"attention": {"fuse_qk_norm": fuse}}, **kw)  # fmt: skip
        assert _greedy(llm, prompts, max_tokens) == want


def test_token_buckets():
    from fulcrum.worker.piecewise_graph import token_buckets

    assert token_buckets(5) == [5]
    assert token_buckets(40) == [8, 16, 32, 40]
    assert token_buckets(1024) == [8, 16, 32, 64, 128, 256, 512, 768, 1024]
    assert token_buckets(1100) == [8, 16, 32, 64, 128, 256, 512, 768, 1024, 1100]


def test_failed_capture_leaves_those_steps_eager(tiny_models, monkeypatch, caplog):
    """A graph capture that fails (out of memory in the graphs' pool, say) is an optimisation
    lost, not an engine lost: a warning, and those steps run eagerly with the same tokens."""
    import torch

    from fulcrum.worker.piecewise_graph import PiecewiseGraphs

    rng = random.Random(8)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=40)  # fmt: skip
    want = _eager(tiny_models["llama"], prompts, [5, 6, 7], **kw)

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(PiecewiseGraphs, "capture", oom)
    llm = LLM(tiny_models["llama"], piecewise_graph_max_tokens=40, **kw)
    runner = llm.core.runner
    with caplog.at_level("WARNING", logger="fulcrum.worker.startup"):
        startup.capture_piecewise(runner, emulate=True)
    assert runner.piecewise is None and not runner.use_cuda_graphs
    assert "capture (piecewise prefill) failed" in caplog.text
    assert _greedy(llm, prompts, [5, 6, 7]) == want


def test_every_step_kind_builds_metadata_that_agrees_with_its_host_lists(
    tiny_models, monkeypatch
):
    """Eager steps, decode-graph replays and piecewise-graph steps all go through
    ``AttentionMetadata.build``: the counts match the host lists, and an eager or piecewise
    step's device tensors hold what its host lists say (a decode graph's host lists are
    placeholders: its kernels read the static device rows)."""
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=40)  # fmt: skip
    llm = LLM(tiny_models["llama"], piecewise_graph_max_tokens=16, **kw)
    runner = llm.core.runner
    kinds: set[str] = set()

    def check(meta) -> None:
        """At attention time: off CUDA a staged tensor is the staging buffer itself."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        assert meta.num_tokens == qsl[-1] and meta.num_reqs == len(lens) == len(qsl) - 1
        assert meta.query_start_loc.tolist() == qsl
        assert meta.block_tables.shape[0] == meta.num_reqs
        assert meta.slot_mapping.shape[0] >= meta.num_tokens
        assert meta.max_query_len == max(b - a for a, b in zip(qsl, qsl[1:], strict=False))
        if meta.is_pure_decode and not any(lens):
            kinds.add("decode graph")
            assert meta.max_seq_len == runner.max_model_len
            return
        assert meta.seq_lens.tolist() == lens and meta.max_seq_len == max(lens)
        kinds.add("piecewise" if meta.slot_mapping.shape[0] > meta.num_tokens else "eager")

    attend = runner.attn_backend.attend
    monkeypatch.setattr(runner.attn_backend, "attend", lambda *a: check(a[-1]) or attend(*a))
    startup.capture_graphs(runner, emulate=True)
    startup.capture_piecewise(runner, emulate=True)
    kinds.clear()  # capture's own steps
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 30, 9)]
    _greedy(llm, prompts, [4, 3, 5])
    assert kinds == {"decode graph", "piecewise", "eager"}


def test_emulated_decode_graphs_sample_in_the_graph(tiny_models, monkeypatch):
    """With ``sample_in_graph`` the decode graph draws its sampled rows itself (the sort-free
    kernels, interpreted here): no sampler call and no patch between replays, greedy rows keep
    the argmax, and a seeded request draws the tokens the sampler after the graph draws (its
    noise keyed by seed and position). A grammar's bitmask or logprobs leave it to the sampler."""
    import fulcrum.worker.step_sampling as ss

    monkeypatch.setattr(ss, "use_triton", lambda *a: True)  # the CUDA sampler, interpreted
    monkeypatch.setattr(startup, "use_triton", lambda *a: True)
    calls: list[int] = []
    real = ss.sample_fused
    monkeypatch.setattr(ss, "sample_fused", lambda x, p, *a: calls.append(len(p)) or real(x, p, *a))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    kw = dict(device="cpu", dtype="float32", attention_backend="triton", max_num_seqs=4)
    want = _eager(tiny_models["llama"], prompts, [6, 6, 6], **kw)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)
    nucleus = SamplingParams(temperature=0.8, min_p=0.05, max_tokens=6, ignore_eos=True)
    batch = [greedy, seeded, nucleus]

    def run(sample_in_graph: bool) -> tuple[list[list[int]], int]:
        """Tokens of the batch, and the vocabulary's size."""
        kc = {"sample_in_graph": sample_in_graph}
        llm = LLM(tiny_models["llama"], async_scheduling="on", kernel_config=kc, **kw)
        runner = llm.core.runner
        startup.capture_graphs(runner, emulate=True)
        assert runner.graphs.sample_in_graph == sample_in_graph
        outside = []
        fill = runner._fill_sampled
        monkeypatch.setattr(runner, "_fill_sampled", lambda *a: outside.append(1) or fill(*a))
        calls.clear()
        outs = llm.generate(prompts, batch, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got[0] == want[0]  # the greedy row: the argmax, drawn beside sampled rows
        assert runner.graphs.num_replays >= 5
        if sample_in_graph:  # the prefill's sampler, then every decode step in its graph
            assert calls == [3] and len(outside) == 1
            # a grammar or logprobs: the graph keeps the argmax and the sampler draws after it
            calls.clear()
            lp = SamplingParams(temperature=0.8, logprobs=1, max_tokens=3, ignore_eos=True)
            assert len(llm.generate(prompts[:1], lp, use_tqdm=False)[0].outputs[0].token_ids) == 3
        else:  # a sampler call after every replay, each followed by a patch
            assert len(calls) >= 6 and len(outside) >= 5
        return got, runner.vocab_size

    in_graph, vocab = run(True)
    after, _ = run(False)
    assert in_graph[1] == after[1]  # seeded: the same draws either way
    assert len(in_graph[2]) == 6 and all(0 <= t < vocab for t in in_graph[2])
