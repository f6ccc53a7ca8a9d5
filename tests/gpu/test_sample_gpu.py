"""The sort-free sampler over Llama-3's 128,256-token vocabulary, on CUDA: its draws follow
the sorting sampler's law (``worker/sampler.py``'s filters, then softmax)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fulcrum.kernels.sample import KEY_STRIDE, pack_params, sample_rows  # noqa: E402
from fulcrum.worker.sampler import apply_min_p, apply_top_k_top_p  # noqa: E402

VOCAB = 128256


def _law(logits: torch.Tensor, t: float, k: int, p: float, mp: float) -> torch.Tensor:
    x = logits.float().unsqueeze(0) / t
    kk = torch.tensor([k], device="cuda") if k > 0 else None
    pp = torch.tensor([p], device="cuda") if p < 1.0 else None
    x = apply_top_k_top_p(x, kk, pp)
    if mp > 0:
        x = apply_min_p(x, torch.tensor([mp], device="cuda"))
    return x.softmax(-1)[0].double()


@pytest.mark.parametrize(
    ("dtype", "t", "k", "p", "mp"),
    [
        (torch.float32, 0.8, -1, 0.95, 0.0),
        (torch.float32, 0.7, -1, 0.9, 0.02),
        (torch.float32, 1.0, -1, 1.0, 0.1),
        (torch.bfloat16, 0.6, 50, 1.0, 0.0),  # top-k keeps whole tie groups, as sorting does
        (torch.bfloat16, 1.0, 1, 1.0, 0.0),
    ],
)
def test_draws_follow_the_sorting_law_at_llama_vocab(dtype, t, k, p, mp) -> None:
    """32,768 draws of one row: none outside the kept set; the 20 likeliest tokens and ten
    bands of equal probability mass each within 5 standard errors of their probability."""
    g = torch.Generator(device="cuda").manual_seed(int(100 * t) + k)
    logits = (torch.randn(VOCAB, device="cuda", generator=g) * 2.5).to(dtype)
    law = _law(logits, t, k, p, mp)
    n, launches = 8192, 4
    rows = logits.unsqueeze(0).expand(n, -1).contiguous()
    ids = []
    for i in range(launches):
        keys = [(i * n + r) * KEY_STRIDE for r in range(n)]
        params = torch.from_numpy(pack_params([[t, k, p, mp]] * n, keys)).cuda()
        ids.append(sample_rows(rows, params))
    ids = torch.cat(ids)
    total = n * launches
    assert law[ids].min() > 0, "a token outside the kept set was drawn"
    freq = torch.bincount(ids, minlength=VOCAB).double() / total
    order = law.argsort(descending=True)
    top = order[:20]
    se = (law[top] * (1 - law[top]) / total).sqrt()
    assert ((freq[top] - law[top]).abs() <= 5 * se + 1e-12).all()
    band = (law[order].cumsum(0) * 10).clamp(max=9.999).long()  # bands of equal mass
    want = torch.zeros(10, dtype=torch.float64, device="cuda").index_add_(0, band, law[order])
    got = torch.zeros(10, dtype=torch.float64, device="cuda").index_add_(0, band, freq[order])
    se = (want * (1 - want) / total).sqrt()
    assert ((got - want).abs() <= 5 * se + 1e-12).all(), (got, want)
