"""Random ragged batches over a paged KV cache, for comparing attention implementations."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxllm.attention_metadata import AttentionMetadata

# (query_len, context_len) per sequence.
KINDS = {
    "decode": [(1, 1), (1, 17), (1, 64), (1, 33), (1, 5), (1, 90)],
    "prefill": [(37, 37), (20, 20), (3, 3)],
    # decodes, a chunk of a prompt whose first 37 tokens are cached, a fresh prompt, a prompt that ends mid-page
    "mixed": [(1, 40), (13, 50), (1, 1), (21, 21), (1, 77), (6, 6)],
}


@dataclasses.dataclass
class Case:
    q: jnp.ndarray
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    meta: AttentionMetadata
    num_real_tokens: int


def make_case(kind: str, *, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype,
              seed: int = 0, pad_tokens: int = 5, pad_seqs: int = 2, cache_dtype=None,
              seqs: list[tuple[int, int]] | None = None) -> Case:
    """Pages are assigned at random; every page no sequence owns is filled with NaN, so an implementation
    that reads a page it does not own produces NaN. cache_dtype: the KV cache's (default: `dtype`); seqs:
    (query_len, context_len) of each sequence instead of the kind's."""
    rng = np.random.default_rng(seed)
    seqs = seqs or KINDS[kind]
    pages_needed = [-(-ctx // page_size) for _, ctx in seqs]
    num_pages = sum(pages_needed) + 7
    perm = rng.permutation(num_pages)
    tables, at = [], 0
    for n in pages_needed:
        tables.append(perm[at:at + n].tolist())
        at += n
    k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    unowned = perm[at:]
    k[:, unowned] = np.nan
    v[:, unowned] = np.nan
    num_tokens = sum(q for q, _ in seqs) + pad_tokens
    meta = AttentionMetadata.build(
        query_lens=[q for q, _ in seqs], context_lens=[c for _, c in seqs], block_tables=tables,
        page_size=page_size, num_tokens=num_tokens, num_seqs=len(seqs) + pad_seqs,
        max_pages_per_seq=max(pages_needed) + 1)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    cache_dtype = cache_dtype or dtype
    return Case(jnp.asarray(q, dtype), jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype), meta,
                sum(q for q, _ in seqs))


def run(fn, case: Case, **kwargs) -> np.ndarray:
    m = case.meta
    out = fn(case.q, case.k_cache, case.v_cache, m.kv_lens, m.block_tables, m.query_start_loc,
             sm_scale=case.q.shape[-1] ** -0.5, **kwargs)
    return np.asarray(out.astype(jnp.float32))
