"""Build a flattened varlen batch and its paged-cache metadata by hand, for kernel tests.

Blocks are handed out from a random permutation of the pool, so neighbouring blocks of one
request are never neighbours in memory::

    request i: seq_lens[i] tokens, the last query_lens[i] of them new this step
    block_tables[i, j] = perm[next ...]      (pad: 0)
    slot_mapping[t]    = block * page_size + offset for each new token; -1 for padding tokens
"""

from __future__ import annotations

import torch

from fulcrum.attention.backend import AttentionMetadata


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_pad_tokens: int = 0,
    spare_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Random cache (the cached prefixes) plus metadata for the new tokens.

    ``generator`` (CPU) draws the block permutation, and the cache too when ``device`` is the CPU.
    """
    assert len(seq_lens) == len(query_lens)
    assert all(0 < q <= s for q, s in zip(query_lens, seq_lens, strict=True))
    per_req = [(s + page_size - 1) // page_size for s in seq_lens]
    num_blocks = sum(per_req) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(per_req)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    nxt = 0
    for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = perm[nxt : nxt + per_req[i]]
        nxt += per_req[i]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // page_size] * page_size + p % page_size for p in range(s - q, s)]
    slots += [-1] * num_pad_tokens
    shape = (2, num_blocks, page_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        kv_cache = torch.randn(shape, generator=generator).to(dtype)
    else:  # large caches: fill on the device, from its default generator
        kv_cache = torch.randn(shape, device=device, dtype=dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        num_tokens=len(slots),
        num_reqs=len(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
    return kv_cache, meta
