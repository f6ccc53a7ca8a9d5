from __future__ import annotations

import pytest
import torch

from fulcrum.kernels.sample import KEY_STRIDE, pack_params, sample_rows, seeded_key
from fulcrum.worker.sampler import apply_min_p, apply_top_k_top_p


def _target(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """The law the sorting sampler draws from (its own filters, then softmax)."""
    x = logits.float().unsqueeze(0) / t
    k = torch.tensor([top_k]) if top_k > 0 else None
    p = torch.tensor([top_p]) if top_p < 1.0 else None
    x = apply_top_k_top_p(x, k, p)
    if min_p > 0:
        x = apply_min_p(x, torch.tensor([min_p]))
    return x.softmax(-1)[0]


def _draw(logits: torch.Tensor, n: int, t: float, k: int, p: float, mp: float, key: int):
    rows = logits.unsqueeze(0).expand(n, -1).contiguous()
    return sample_rows(rows, _params(n, t, k, p, mp, key))


def _pack(rows: list[list[float]], key: int = 0) -> torch.Tensor:
    return torch.from_numpy(pack_params(rows, [key + i * KEY_STRIDE for i in range(len(rows))]))


def _params(n: int, t: float, k: int, p: float, mp: float, key: int = 0) -> torch.Tensor:
    return _pack([[t, k, p, mp]] * n, key)


@pytest.mark.parametrize(
    ("vocab", "t", "k", "p", "mp"),
    [
        (40, 1.0, -1, 1.0, 0.0),  # plain draw
        (40, 0.7, -1, 0.8, 0.0),  # top-p
        (300, 1.3, 5, 1.0, 0.0),  # top-k, two interpreter chunks (256 + 44)
        (40, 1.0, -1, 0.9, 0.05),  # top-p then min-p
        (40, 0.5, 7, 1.0, 0.1),  # top-k then min-p
    ],
)
def test_draws_follow_the_sorting_samplers_law(vocab, t, k, p, mp) -> None:
    """200 draws: never outside the kept set, and each token's frequency within 5 standard
    errors of its probability under the sorting sampler's filters."""
    g = torch.Generator().manual_seed(vocab + int(100 * p))
    logits = torch.randn(vocab, generator=g) * 2.0
    want = _target(logits, t, k, p, mp)
    n = 200
    ids = _draw(logits, n, t, k, p, mp, key=11)
    assert ids.dtype == torch.int64 and ids.shape == (n,)
    assert want[ids].min() > 0, "a token outside the kept set was drawn"
    freq = torch.bincount(ids, minlength=vocab).double() / n
    se = (want.double() * (1 - want.double()) / n).sqrt()
    assert ((freq - want.double()).abs() <= 5 * se + 1e-9).all()


def test_greedy_rows_ties_seeds_and_ragged_vocab() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1000, generator=g).to(torch.bfloat16)  # 1,000: a partial last chunk
    x[1, 999] = 40.0  # the last column
    x[2, 5] = x[2, 700] = 40.0  # a tie across chunks: the first wins
    params = _pack([[0, -1, 1, 0], [0, 3, 1, 0], [0, -1, 0.5, 0], [1, -1, 0.9, 0]], key=1)
    ids = sample_rows(x, params)
    assert ids[:3].tolist() == x[:3].float().argmax(-1).tolist() == [ids[0].item(), 999, 5]
    assert torch.equal(ids, sample_rows(x, params))  # the same keys, the same draws
    # a random row varies with its key and stays inside its nucleus
    draws = {int(sample_rows(x[3:4], _pack([[1, -1, 0.9, 0]], key=s))[0]) for s in range(8)}
    assert len(draws) > 1
    kept = _target(x[3], 1.0, -1, 0.9, 0.0) > 0
    assert all(kept[d] for d in draws)


def test_a_peaked_row_rejects_until_the_nucleus() -> None:
    """One token holds 90%: with top-p 0.5 every draw must be that token (draws elsewhere are
    rejected, possibly several rounds in a row)."""
    x = torch.zeros(64, 300)
    x[:, 123] = 8.0  # exp(8) / (exp(8) + 299) ~ 0.91
    ids = sample_rows(x, _params(64, 1.0, -1, 0.5, 0.0))
    assert (ids == 123).all()
    # top-p 0.95 keeps more than the top token: both kinds occur over 64 rows
    ids = sample_rows(x, _params(64, 1.0, -1, 0.95, 0.0, key=5))
    assert (ids == 123).any() and (ids != 123).any()


def test_nan_rows_end_and_rejections_stop_at_the_cap(monkeypatch) -> None:
    """NaN logits (nothing eligible) and a row past MAX_ROUNDS rejections still end: the
    latter with its most likely token."""
    import fulcrum.kernels.sample as sample_mod

    x = torch.full((1, 100), float("nan"))
    assert 0 <= int(sample_rows(x, _params(1, 1.0, -1, 0.9, 0.0))[0]) < 100
    monkeypatch.setattr(sample_mod, "MAX_ROUNDS", 1)  # round 0's draw, then the argmax
    x = torch.randn(3, 100)
    assert torch.equal(sample_rows(x, _params(3, 3.0, 1, 1.0, 0.0)), x.argmax(-1))


def test_skip_greedy_leaves_greedy_rows_as_written() -> None:
    """``skip_greedy`` (the decode graphs' sampler, after their argmax): rows of temperature 0
    keep what ``out`` held, the others draw exactly what they draw without it."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 700, generator=g)
    params = _pack([[0, -1, 1, 0], [0.8, -1, 0.9, 0], [0, -1, 1, 0], [1.2, 5, 1, 0.05]], key=9)
    out = torch.tensor([-7, -7, 123, -7])
    sample_rows(x, params, out=out, skip_greedy=True)
    want = sample_rows(x, params)
    assert out[0] == -7 and out[2] == 123  # untouched
    assert out[1] == want[1] and out[3] == want[3]
    with pytest.raises(ValueError, match="out"):
        sample_rows(x, params, skip_greedy=True)


def test_bad_columns_are_named() -> None:
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="params"):
        sample_rows(x, _params(3, 1.0, -1, 1.0, 0.0))
    with pytest.raises(ValueError, match="params"):
        sample_rows(x, torch.ones(2, 6))
    with pytest.raises(ValueError, match="stride"):
        sample_rows(x.t(), _params(10, 1.0, -1, 1.0, 0.0))


def test_packed_params_and_seeded_keys() -> None:
    buf = pack_params([[0.8, 50, 0.95, 0.05]], [2**61 + 12345])
    assert buf.dtype.name == "int32" and buf.shape == (1, 6)
    assert buf[0, :4].view("float32").tolist() == pytest.approx([0.8, 50, 0.95, 0.05])
    assert int(buf[0, 4:].view("int64")[0]) == 2**61 + 12345
    # a seeded request's keys: fixed by (seed, index, position), apart for neighbours
    assert seeded_key(7, 0, 100) == seeded_key(7, 0, 100)
    keys = {seeded_key(s, i, pos) for s in (7, 8) for i in (0, 1) for pos in (100, 101)}
    assert len(keys) == 8 and all(0 <= k < 2**61 for k in keys)


_IR_CHECK = """
import triton._C.libtriton as lt
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from fulcrum.kernels.sample import _round0_kernel, _sample_kernel

ptrs = {"x_ptr": "*bf16", "stride_x": "i32", "params_ptr": "*i32", "part_ptr": "*fp32"}
kernels = [
    (
        _round0_kernel,
        {**ptrs, "V": "i32", "SLICE": "i32", "CHUNK": "constexpr", "SKIP_GREEDY": "constexpr",
         "FAST": "constexpr"},
        {"CHUNK": 4096, "SKIP_GREEDY": skip, "FAST": True},
    )
    for skip in (False, True)
] + [
    (
        _sample_kernel,
        {**ptrs, "out_ptr": "*i64", "V": "i32", "SPLITS": "constexpr", "CHUNK": "constexpr",
         "MAX_ROUNDS": "constexpr", "SKIP_GREEDY": "constexpr", "FAST": "constexpr"},
        {"SPLITS": 32, "CHUNK": 4096, "MAX_ROUNDS": 64, "SKIP_GREEDY": skip, "FAST": True},
    )
    for skip in (False, True)
]
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
opts = backend.parse_options({})
for fn, sig, constexprs in kernels:
    ctx = lt.ir.context()
    lt.ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn, sig, constexprs=constexprs)
    codegen = backend.get_codegen_implementation(opts)
    src.make_ir(target, opts, codegen, backend.get_module_map(), ctx)
"""


def test_the_kernel_compiles_for_hopper() -> None:
    """The interpreter runs code the compiler rejects (a loop-carried value that changes type,
    say): build the kernels' Triton IR for sm_90 in a process without the interpreter."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _IR_CHECK], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
