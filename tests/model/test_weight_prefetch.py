"""Where the decoder asks for L2 weight prefetches (``model/layers/prefetch.py``): on a decode
step of a few tokens each weight is requested after the GEMV before it and ahead of the small
kernels that precede its own GEMV; larger steps request nothing. The prefetch instruction itself needs
a Hopper GPU and a CUDA-graph capture (tests/gpu); here the kernel launch is recorded instead."""

from __future__ import annotations

import pytest
from torch import nn

from fulcrum import LLM, SamplingParams


def test_prefetch_requests_precede_their_gemvs(tiny_models, monkeypatch: pytest.MonkeyPatch):
    from fulcrum.kernels import l2_prefetch
    from fulcrum.model.layers import prefetch

    llm = LLM(tiny_models["llama"], device="cpu", dtype="float32", attention_backend="torch")
    model = llm.core.runner.model
    names = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    events: list[tuple[str, str, int | None]] = []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(lambda mod, _, n=n: events.append(("gemm", n, None)))
    monkeypatch.setattr(prefetch, "use_triton", lambda x: True)
    monkeypatch.setattr(prefetch, "_capturing", lambda: True)
    monkeypatch.setattr(l2_prefetch, "supported", lambda t: True)
    monkeypatch.setattr(
        l2_prefetch, "prefetch", lambda t, n=None: events.append(("prefetch", names[id(t)], n))
    )
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = list(range(5, 5 + 2 * prefetch.MAX_TOKENS))
    llm.generate([prompt], sp, use_tqdm=False)

    steps: list[list] = [[]]
    for e in events:
        steps[-1].append(e)
        if e[:2] == ("gemm", "lm_head"):
            steps.append([])
    prefill, *decodes, tail = steps
    assert not tail and len(decodes) == 2
    assert all(kind == "gemm" for kind, _, _ in prefill)  # more than MAX_TOKENS tokens
    budget = prefetch.BUDGET
    for step in decodes:
        want = []
        for i in range(len(model.model.layers)):
            for short, full in (
                ("qkv", "self_attn.qkv_proj"),
                ("o_proj", "self_attn.o_proj"),
                ("gate_up", "mlp.gate_up_proj"),
                ("down", "mlp.down_proj"),
            ):
                name = f"model.layers.{i}.{full}"
                want += [("prefetch", name, budget[short]), ("gemm", name, None)]
        assert step == want + [("gemm", "lm_head", None)]

    events.clear()
    monkeypatch.setattr(prefetch, "ENABLED", False)
    llm.generate([prompt], sp, use_tqdm=False)
    assert events and all(kind == "gemm" for kind, _, _ in events)
