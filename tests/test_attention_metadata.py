"""`AttentionMetadata.build`, vectorised over the step, against a per-sequence construction of the same arrays;
and its refusals."""

import numpy as np
import pytest

from jaxllm.attention_metadata import AttentionMetadata


def per_sequence(query_lens, context_lens, block_tables, page_size, num_tokens, num_seqs, max_pages):
    slots = np.full(num_tokens, -1, np.int32)
    tables = np.zeros((num_seqs, max_pages), np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    qsl = np.zeros(num_seqs + 1, np.int32)
    t = 0
    for i, (q, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        for pos in range(ctx - q, ctx):
            slots[t + pos - (ctx - q)] = table[pos // page_size] * page_size + pos % page_size
        tables[i, :len(table)] = table
        kv_lens[i] = ctx
        t += q
        qsl[i + 1:] = t
    return slots, tables, kv_lens, qsl


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_a_per_sequence_construction(seed):
    rng = np.random.default_rng(seed)
    page_size, max_pages = (16, 8) if seed % 2 else (4, 20)
    n = int(rng.integers(0, 9))
    query_lens, context_lens, tables = [], [], []
    free = list(rng.permutation(400))
    for _ in range(n):  # decodes, prefill chunks, whole prompts; tables with spare pages at the end
        ctx = int(rng.integers(1, page_size * max_pages + 1))
        query_lens.append(int(rng.choice([1, ctx, rng.integers(1, ctx + 1)])))
        context_lens.append(ctx)
        pages = min(max_pages, -(-ctx // page_size) + int(rng.integers(0, 2)))
        tables.append([int(free.pop()) for _ in range(pages)])
    num_tokens, num_seqs = sum(query_lens) + int(rng.integers(0, 5)), n + int(rng.integers(0, 3))
    meta = AttentionMetadata.build(query_lens=query_lens, context_lens=context_lens, block_tables=tables,
                                   page_size=page_size, num_tokens=num_tokens, num_seqs=num_seqs,
                                   max_pages_per_seq=max_pages)
    want = per_sequence(query_lens, context_lens, tables, page_size, num_tokens, num_seqs, max_pages)
    for name, got, expected in zip(("slot_mapping", "block_tables", "kv_lens", "query_start_loc"),
                                   (meta.slot_mapping, meta.block_tables, meta.kv_lens, meta.query_start_loc),
                                   want, strict=True):
        assert got.dtype == np.int32 and np.array_equal(got, expected), name


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(query_lens=[1], context_lens=[40], block_tables=[[3, 4]]), "2 pages cannot hold 40 tokens"),
    (dict(query_lens=[1, 1], context_lens=[4], block_tables=[[3]]), "2 query lengths, 1 context lengths"),
    (dict(query_lens=[1], context_lens=[4], block_tables=[[1, 2, 3]], max_pages_per_seq=2), "3 pages does not fit"),
    (dict(query_lens=[5], context_lens=[5], block_tables=[[1]], num_tokens=4), "do not fit the shape"),
])
def test_build_refuses_what_does_not_fit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(page_size=16, **kwargs)
