"""Sliding-window and soft-capped attention kernels at Gemma shapes, on CUDA, against their torch
references: 16 query heads, 8 kv heads, head_dim 256, page 16, windows 1024 and 4096 (Gemma 3 /
Gemma 2), cap 50 (Gemma 2), contexts past the window; bf16."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from paged_batch import make_paged_batch  # noqa: E402

from fulcrum.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from fulcrum.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_ref,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize(("window", "softcap"), [(1024, None), (4096, 50.0), (None, 50.0)])
def test_window_softcap_gpu(window, softcap) -> None:
    g = torch.Generator(device="cpu").manual_seed(3)
    seq_lens, query_lens = [3000, 1500, 900, 5000], [700, 1, 900, 1]
    cache, meta = make_paged_batch(seq_lens, query_lens, 8, 256, 16, generator=g)
    cache = cache.to(DEV, torch.bfloat16)
    q = torch.randn(meta.num_tokens, 16, 256, generator=g).to(DEV, torch.bfloat16)
    bt, sl, qsl = (t.to(DEV) for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc))
    out = prefill_attention(q, cache, bt, sl, qsl, meta.max_query_len, 0.0625,
                            skip_decode=True, window=window, softcap=softcap)  # fmt: skip
    ref = prefill_attention_ref(q, cache, bt, sl, qsl, 0.0625, window=window, softcap=softcap)
    rows = torch.cat([torch.arange(0, 700), torch.arange(701, 1601)]).to(DEV)
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
    dec = torch.tensor([1, 3], device=DEV)
    qd = q[torch.tensor([700, 1601], device=DEV)]
    for splits in (1, 8):
        o = decode_attention(qd, cache, bt[dec], sl[dec], 0.0625, num_splits=splits,
                             window=window, softcap=softcap)  # fmt: skip
        r = decode_attention_ref(qd, cache, bt[dec], sl[dec], 0.0625, window=window, softcap=softcap)
        torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)
