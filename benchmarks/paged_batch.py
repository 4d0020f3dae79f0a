"""A random ragged batch over a paged KV cache, for the attention benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.attention_metadata import AttentionMetadata


def random_paged_batch(seqs: list[tuple[int, int]], heads: tuple[int, int, int], page_size: int, dtype,
                       seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, AttentionMetadata]:
    """(q [T, H, D], this step's k/v [T, KVH, D], k_cache, v_cache [KVH, pages, page_size, D], metadata) for
    sequences of (query_len, context); each sequence's pages are a random draw, one page is left unowned."""
    h, kvh, d = heads
    rng = np.random.default_rng(seed)
    pages = [-(-ctx // page_size) for _, ctx in seqs]
    perm = rng.permutation(sum(pages) + 1)
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at:at + n].tolist())
        at += n
    meta = AttentionMetadata.build(query_lens=[q for q, _ in seqs], context_lens=[c for _, c in seqs],
                                   block_tables=tables, page_size=page_size)
    t = sum(q for q, _ in seqs)
    shape = (kvh, sum(pages) + 1, page_size, d)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((t, h, d)), dtype)
    new = jnp.asarray(rng.standard_normal((t, kvh, d)), dtype)
    return q, new, k, v, meta
