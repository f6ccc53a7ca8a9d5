"""``AttentionMetadata.build``: the one way a step's attention metadata is made."""

from __future__ import annotations

import torch

from fulcrum.attention.backend import AttentionMetadata


def test_build_reads_the_counts_off_the_host_query_starts() -> None:
    """A mixed step of three requests (a 5-token prefill chunk, a decode, a 3-token chunk)
    staged into a 16-token graph bucket: the counts come from the host query starts, not from
    the padded slot mapping."""
    qsl, seq_lens = [0, 5, 6, 9], [5, 10, 3]
    slots = torch.cat([torch.arange(9), torch.full((7,), -1)])
    table = torch.zeros(3, 2, dtype=torch.int32)
    meta = AttentionMetadata.build(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=slots,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=5,
        max_seq_len=10,
    )
    assert (meta.num_tokens, meta.num_reqs) == (9, 3)
    assert meta.slot_mapping is slots and meta.block_tables is table
    assert meta.query_start_loc_cpu == qsl and meta.seq_lens_cpu == seq_lens
    assert (meta.max_query_len, meta.max_seq_len) == (5, 10)
    assert not meta.is_pure_decode and meta.backend_cache == {}


def test_decode_graph_metadata_is_its_bucket_of_static_rows() -> None:
    """A decode graph's metadata: ``b`` one-token requests over the static buffers' first ``b``
    rows, sized for the longest context the graph serves."""
    from fulcrum.worker.cuda_graph import DecodeGraphs, capture_sizes

    graphs = DecodeGraphs(None, capture_sizes(8), 8, 16, 4096, torch.device("cpu"))
    meta = graphs._meta(4)
    assert (meta.num_tokens, meta.num_reqs, meta.max_seq_len) == (4, 4, 4096)
    assert meta.is_pure_decode
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.data_ptr() == graphs.tokens[2].data_ptr()
    assert meta.seq_lens.data_ptr() == graphs.seq_lens.data_ptr()
    assert meta.block_tables.shape == (4, 8)
