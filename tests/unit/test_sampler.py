"""Sampler: each filter against a direct computation, penalties, seeds, logprobs, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from fulcrum.sampling_params import SamplingParams
from fulcrum.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
)

# Chi-square critical values at p = 1e-4 for 1..9 degrees of freedom.
CHI2_CRIT = [15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88, 31.83, 33.72]
DRAWS = 20_000


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    batch, vocab = logits.shape
    meta = SamplingMetadata.build(
        params,
        generators or [None] * batch,
        outputs if outputs is not None else [[] for _ in range(batch)],
        prompts if prompts is not None else [[] for _ in range(batch)],
        vocab,
        logits.device,
    )
    return Sampler()(logits, meta)


def draw_counts(probs: list[float], params: SamplingParams, n: int = DRAWS) -> torch.Tensor:
    """Sample ``n`` times from one row (as one batch of ``n`` identical rows); token counts."""
    torch.manual_seed(1234)
    logits = logits_of(probs).expand(n, -1).contiguous()
    out = run(logits, [params] * n)
    return torch.bincount(out.sampled_token_ids, minlength=len(probs))


def assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Support equals the expected support, and frequencies pass a chi-square test."""
    support = set(torch.nonzero(counts).flatten().tolist())
    assert support == set(torch.nonzero(expected).flatten().tolist())
    n = counts.sum().item()
    exp = expected / expected.sum() * n
    keep = expected > 0
    stat = (((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum().item()
    dof = int(keep.sum().item()) - 1
    if dof > 0:
        assert stat < CHI2_CRIT[dof - 1], (counts.tolist(), exp.tolist(), stat)


def masked(probs: list[float], keep: list[int]) -> torch.Tensor:
    p = torch.tensor(probs, dtype=torch.float64)
    out = torch.zeros_like(p)
    out[keep] = p[keep]
    return out


PROBS = [0.3, 0.25, 0.2, 0.15, 0.07, 0.03]


def test_plain_sampling_matches_softmax() -> None:
    counts = draw_counts(PROBS, SamplingParams(temperature=1.0))
    assert_distribution(counts, torch.tensor(PROBS, dtype=torch.float64))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(temperature: float) -> None:
    counts = draw_counts(PROBS, SamplingParams(temperature=temperature))
    expected = (logits_of(PROBS).double() / temperature).softmax(-1)
    assert_distribution(counts, expected)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k(k: int) -> None:
    counts = draw_counts(PROBS, SamplingParams(top_k=k))
    assert_distribution(counts, masked(PROBS, list(range(k))))


@pytest.mark.parametrize("k", [-1, 6, 100])
def test_top_k_off(k: int) -> None:
    counts = draw_counts(PROBS, SamplingParams(top_k=k))
    assert_distribution(counts, torch.tensor(PROBS, dtype=torch.float64))


@pytest.mark.parametrize(
    ("p", "keep"),
    [
        (0.01, [0]),  # the top token always stays
        (0.5, [0, 1]),  # 0.3 < 0.5 <= 0.55
        (0.6, [0, 1, 2]),  # 0.55 < 0.6 <= 0.75
        (0.95, [0, 1, 2, 3, 4]),  # 0.9 < 0.95 <= 0.97
        (1.0, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_top_p(p: float, keep: list[int]) -> None:
    counts = draw_counts(PROBS, SamplingParams(top_p=p))
    assert_distribution(counts, masked(PROBS, keep))


def test_top_p_sees_top_k_renormalised() -> None:
    # top-3 renormalised: 0.4, 0.333, 0.267 -> top_p 0.7 keeps two; on the raw
    # distribution it would keep three (0.3 + 0.25 < 0.7).
    counts = draw_counts(PROBS, SamplingParams(top_k=3, top_p=0.7))
    assert_distribution(counts, masked(PROBS, [0, 1]))


@pytest.mark.parametrize(
    ("min_p", "keep"),
    [(0.2, [0, 1, 2, 3, 4]), (0.6, [0, 1, 2]), (0.9, [0]), (0.0, [0, 1, 2, 3, 4, 5])],
)
def test_min_p(min_p: float, keep: list[int]) -> None:
    # thresholds: 0.06, 0.18, 0.27 of the top probability 0.3
    counts = draw_counts(PROBS, SamplingParams(min_p=min_p))
    assert_distribution(counts, masked(PROBS, keep))


def test_filters_per_row_in_one_batch() -> None:
    settings = [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.6), [0, 1, 2]),
        (SamplingParams(min_p=0.6), [0, 1, 2]),
        (SamplingParams(temperature=1.0), list(range(6))),
        (SamplingParams(temperature=0.0), [0]),
    ]
    n = 4000
    torch.manual_seed(99)
    params = [p for p, _ in settings for _ in range(n)]
    logits = logits_of(PROBS).expand(len(params), -1).contiguous()
    out = run(logits, params).sampled_token_ids.view(len(settings), n)
    for i, (_, keep) in enumerate(settings):
        assert_distribution(torch.bincount(out[i], minlength=6), masked(PROBS, keep))


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    out = run(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.sampled_ranks is None


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=3) for i in range(8)]
    out = run(logits, params).sampled_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    top3 = logits[1::2].topk(3).indices
    assert bool((top3 == out[1::2].unsqueeze(1)).any(-1).all())


def reference_penalties(
    logits: torch.Tensor,
    outputs: list[list[int]],
    prompts: list[list[int]],
    params: list[SamplingParams],
) -> torch.Tensor:
    """Element by element, as the definitions read."""
    ref = logits.clone()
    for b, p in enumerate(params):
        for t in range(logits.shape[1]):
            x = ref[b, t].item()
            if t in outputs[b] or t in prompts[b]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[b].count(t)
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (1.0 if count > 0 else 0.0)
            ref[b, t] = x
    return ref


def test_penalties_match_hand_computation() -> None:
    torch.manual_seed(3)
    vocab = 12
    logits = torch.randn(4, vocab) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        SamplingParams(),  # no penalty in this row
    ]
    outputs = [[1, 1, 5], [2, 2, 2, 7, 0], [3, 3, 11, 4], [1, 2, 3]]
    prompts = [[0, 7, 7], [9], [10, 1, 3], [4, 5]]
    meta = SamplingMetadata.build(params, [None] * 4, outputs, prompts, vocab, "cpu")
    got = apply_penalties(logits.clone(), meta)
    want = reference_penalties(logits, outputs, prompts, params)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], logits[3])


def test_repetition_penalty_counts_prompt_tokens() -> None:
    logits = torch.tensor([[4.0, 3.9, -1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    # Token 0 appears only in the prompt: 4.0 / 1.2 < 3.9, so token 1 wins.
    assert run(logits, params, outputs=[[]], prompts=[[0]]).sampled_token_ids.tolist() == [1]
    assert run(logits, params, outputs=[[]], prompts=[[2]]).sampled_token_ids.tolist() == [0]


def test_build_skips_unused_features() -> None:
    meta = SamplingMetadata.build([SamplingParams()] * 3, [None] * 3, [[]] * 3, None, 50, "cpu")
    assert meta.all_random and not meta.all_greedy
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.presence_penalty is None and meta.frequency_penalty is None
    assert meta.repetition_penalty is None and meta.prompt_token_ids is None
    assert meta.max_num_logprobs is None and meta.min_tokens_stop_ids == {}
    assert meta.temperature.dtype == torch.float32

    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_k=5, logprobs=7)]
    meta = SamplingMetadata.build(params, [None, None], [[], []], None, 50, "cpu")
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_k is not None and meta.top_k.tolist() == [-1, 5]
    assert meta.max_num_logprobs == 7
    with pytest.raises(ValueError):
        SamplingMetadata.build(
            [SamplingParams(repetition_penalty=1.1)], [None], [[]], None, 50, "cpu"
        )


def test_min_tokens_masks_stop_ids() -> None:
    eos, stop = 0, 1
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    params.all_stop_token_ids = {eos}
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]] * 3)
    outputs = [[2, 2], [2, 2, 2], [2]]
    meta = SamplingMetadata.build([params] * 3, [None] * 3, outputs, None, 4, "cpu")
    assert meta.min_tokens_stop_ids == {0: {eos, stop}, 2: {eos, stop}}
    out = Sampler()(logits, meta).sampled_token_ids
    assert out.tolist() == [2, 0, 2]

    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    ignore.all_stop_token_ids = {eos}
    meta = SamplingMetadata.build([ignore], [None], [[]], None, 4, "cpu")
    assert meta.min_tokens_stop_ids == {0: {stop}}
    assert Sampler()(logits[:1], meta).sampled_token_ids.tolist() == [0]


def test_min_tokens_masks_random_rows() -> None:
    params = SamplingParams(temperature=1.0, min_tokens=5)
    params.all_stop_token_ids = {0}
    torch.manual_seed(0)
    logits = logits_of([0.9, 0.05, 0.05]).expand(2000, -1).contiguous()
    out = run(logits, [params] * 2000).sampled_token_ids
    assert 0 not in out.tolist()


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    torch.manual_seed(5)
    vocab = 40
    logits = torch.randn(5, vocab) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0),
        SamplingParams(temperature=0.7, top_k=10, logprobs=5),
        SamplingParams(temperature=1.5),  # no logprobs asked; still filled (batch max)
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1),
    ]
    top = logits.argmax(-1).tolist()
    outputs = [[], [top[1]] * 3, [], [], []]
    prompts = [[], [], [], [], [top[4]]]
    out = run(logits, params, outputs=outputs, prompts=prompts)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.sampled_ranks is not None
    assert out.logprobs.shape == (5, 6) and out.logprob_token_ids.shape == (5, 6)
    ref = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(1, sampled[:, None]).squeeze(1))
    ref_top = ref.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], ref_top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], ref_top.values)
    order = ref.argsort(dim=-1, descending=True)
    for b in range(5):
        rank = order[b].tolist().index(sampled[b].item()) + 1
        assert out.sampled_ranks[b].item() == rank
    # The penalties moved rows 1 and 4 off the raw argmax: rank 2 in the raw distribution.
    assert out.sampled_ranks[0].item() == 1
    assert out.sampled_ranks[1].item() == 2 and out.sampled_ranks[4].item() == 2


def _generate(
    rows: list[tuple[str, SamplingParams, int | None]], steps: int, vocab: int
) -> dict[str, list[int]]:
    """Run ``steps`` decode steps for a batch; each row's logits depend on its own history."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(42)) * 2
    gens = [
        torch.Generator().manual_seed(seed) if seed is not None else None for _, _, seed in rows
    ]
    history: dict[str, list[int]] = {name: [] for name, _, _ in rows}
    for _ in range(steps):
        last = [history[name][-1] if history[name] else 0 for name, _, _ in rows]
        logits = table[torch.tensor(last)]
        outs = [list(history[name]) for name, _, _ in rows]
        params = [p for _, p, _ in rows]
        meta = SamplingMetadata.build(params, gens, outs, outs, vocab, "cpu")
        sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
        for (name, _, _), tok in zip(rows, sampled, strict=True):
            history[name].append(tok)
    return history


def test_seeded_requests_ignore_batch_composition() -> None:
    vocab = 64
    a = SamplingParams(temperature=1.0, seed=7)
    b = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=11)
    other = SamplingParams(temperature=1.2, presence_penalty=0.5)
    torch.manual_seed(0)
    first = _generate([("a", a, 7), ("x", other, None), ("b", b, 11)], 20, vocab)
    torch.manual_seed(1)
    second = _generate(
        [
            ("y", other, None),
            ("b", b, 11),
            ("z", other, 3),
            ("g", SamplingParams(temperature=0.0), None),
            ("a", a, 7),
        ],
        20,
        vocab,
    )
    assert first["a"] == second["a"]
    assert first["b"] == second["b"]
    assert len(set(first["a"])) > 3  # really sampled, not a fixed point
    third = _generate([("a", a, 8)], 20, vocab)
    assert third["a"] != first["a"]


def test_unseeded_rows_use_global_generator() -> None:
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    torch.manual_seed(17)
    one = run(logits, params).sampled_token_ids
    torch.manual_seed(17)
    two = run(logits, params).sampled_token_ids
    assert torch.equal(one, two)
    assert len(set(one.tolist())) > 1


def test_does_not_modify_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, top_k=4, min_tokens=2),
        SamplingParams(top_p=0.5, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, min_p=0.3, logprobs=2),
    ]
    for p in params:
        p.all_stop_token_ids = {0}
    run(logits, params, outputs=[[1], [2, 2], []], prompts=[[3], [], [4]])
    assert torch.equal(logits, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_has_no_host_sync() -> None:
    device = torch.device("cuda")
    vocab = 32_000
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.2,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            min_tokens=4,
        ),
    ]
    params[2].all_stop_token_ids = {2}
    gens = [None, torch.Generator(device=device).manual_seed(3), None]
    outputs = [[1, 2, 3], [4, 4], [5]]
    prompts = [[7, 8], [9], [10, 11, 12]]
    logits = torch.randn(3, vocab, device=device)
    meta = SamplingMetadata.build(params, gens, outputs, prompts, vocab, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.sampled_token_ids[0].item() == logits[0].argmax().item()
    assert math.isfinite(out.logprobs[0, 0].item())  # type: ignore[index]
