"""Pure-jnp ragged paged attention: the numerical reference, and the fast path on CPU.

Flash attention over (query block, KV block) tiles, in plain jnp:
- the flat token batch is regrouped into blocks of ``block_q`` query tokens that each belong to one sequence
  (a sequence's chunk fills ``ceil(q_len / block_q)`` blocks; the number of blocks is bounded statically
  by ``ceil(T / block_q) + S * (block_q - 1) / block_q``);
- a loop walks the context in blocks of ``kv_block_pages`` pages, gathering each query block's own pages
  (``[blocks, block, D]``: each sequence's KV is read once per query block, never once per token), and
  folds ``[block_q * group, block]`` score tiles (real matmuls) into an online softmax;
- the loop stops at the longest context in the batch; pages past a sequence's context are never read.

``block_q`` defaults from the static shapes: 1 for decode batches (T == S), up to 32 tokens when
sequences bring many tokens each. Memory stays ``O(blocks * block)``; no ``[T, max_context]`` matrix.

Attention sinks (GPT-OSS: a learned logit per q head that joins every softmax's denominator and adds no value)
are folded into the softmax's state once, after the keys (`fold_sinks`), as every kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a fully masked row must give exp(-big - -big) = 1 on garbage, not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def fold_sinks(m: jax.Array, denom: jax.Array, acc: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An online softmax's state (running max m and sum denom [..., 1], unnormalised acc [..., D]) with one more key
    of score `sink` [..., 1] and a zero value: -> (denom, acc), to normalise as before. A row that saw no key
    gets denom 1 and acc 0 (an output of zeros, as without the sink)."""
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_new)
    return denom * alpha + jnp.exp(sink - m_new), acc * alpha


def default_block_q(num_tokens: int, num_seqs: int) -> int:
    """Largest power of two <= the mean tokens per sequence, capped at 32."""
    mean = max(1, num_tokens // max(1, num_seqs))
    return min(32, 1 << (mean.bit_length() - 1))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "kv_block_pages", "block_q"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, max_pages_per_seq] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # None: none; an int or a traced int32 scalar (per layer)
    soft_cap: float | None = None,
    kv_block_pages: int | None = None,
    block_q: int | None = None,
    sinks: jax.Array | None = None,  # [num_heads]: each q head's sink logit (None: no sinks)
) -> jax.Array:  # [T, num_heads, head_dim]
    t, h, d = q.shape
    kvh, num_pages, page_size, _ = k_cache.shape
    num_seqs, max_pages = block_tables.shape
    g = h // kvh
    bq = block_q or default_block_q(t, num_seqs)
    nb = min(t, -(-t // bq) + num_seqs * (bq - 1) // bq)  # static bound on the number of query blocks
    kv_block_pages = kv_block_pages or max(1, 128 // page_size)
    kv_block = kv_block_pages * page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, -max_pages % kv_block_pages)))

    # Query blocks: which sequence, which tokens, at which positions.
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    blocks_per_seq = (q_lens + bq - 1) // bq
    block_ends = jnp.cumsum(blocks_per_seq)
    blk = jnp.arange(nb, dtype=jnp.int32)
    bseq = jnp.searchsorted(block_ends, blk, side="right").astype(jnp.int32)  # [nb]
    bvalid = bseq < num_seqs
    bseq = jnp.minimum(bseq, num_seqs - 1)
    offset = (blk - (block_ends[bseq] - blocks_per_seq[bseq]))[:, None] * bq + jnp.arange(bq)  # [nb, bq]
    row_valid = bvalid[:, None] & (offset < q_lens[bseq][:, None]) & (kv_lens[bseq][:, None] > 0)
    tok = jnp.where(row_valid, query_start_loc[bseq][:, None] + offset, t)  # [nb, bq]; t = padding
    q_pos = (kv_lens[bseq] - q_lens[bseq])[:, None] + offset  # [nb, bq]
    blk_kv_len = jnp.where(bvalid, kv_lens[bseq], 0)  # [nb]
    blk_tables = tables[bseq]  # [nb, padded_max_pages]

    qb = jnp.take(q, tok, axis=0, mode="fill", fill_value=0).astype(jnp.float32) * sm_scale  # [nb, bq, h, d]
    # Block-major tiles: XLA:CPU runs the batched matmuls fastest with the query-block dim leading, even
    # though the gathered pages then need a transpose (decode ran ~1.5x slower kv-head-major here).
    qb = qb.reshape(nb, bq, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(nb, kvh, bq * g, d)
    row_pos = jnp.repeat(q_pos, g, axis=1)[:, None, :, None]  # [nb, 1, bq * g, 1]
    row_ok = jnp.repeat(row_valid, g, axis=1)[:, None, :, None]

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(blk_tables, j * kv_block_pages, kv_block_pages, axis=1)
        first_pos = j * kv_block + jnp.arange(kv_block_pages) * page_size
        pages = jnp.where(first_pos[None, :] < blk_kv_len[:, None], pages, num_pages)  # past context: no read

        def gather(cache):  # -> [nb, kv_heads, kv_block, D]
            blocks = jnp.take(cache, pages, axis=1, mode="fill", fill_value=0)  # [kvh, nb, pages, page, D]
            return blocks.reshape(kvh, nb, kv_block, d).swapaxes(0, 1).astype(jnp.float32)

        k, v = gather(k_cache), gather(v_cache)
        s = jnp.einsum("nkqd,nkcd->nkqc", qb, k)  # [nb, kv_heads, bq * g, kv_block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * kv_block + jnp.arange(kv_block)
        mask = (kv_pos <= row_pos) & row_ok
        if sliding_window is not None:
            mask &= kv_pos > row_pos - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(-1, keepdims=True)
        acc = acc * alpha + jnp.einsum("nkqc,nkcd->nkqd", p, v)
        return m_new, denom, acc

    num_kv_blocks = (jnp.max(kv_lens) + kv_block - 1) // kv_block
    init = (jnp.full((nb, kvh, bq * g, 1), MASK_VALUE, jnp.float32), jnp.zeros((nb, kvh, bq * g, 1), jnp.float32),
            jnp.zeros((nb, kvh, bq * g, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    if sinks is not None:  # row b * g + j of KV head k is q head k * g + j
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(kvh, 1, g), (1, bq, 1)).reshape(1, kvh, bq * g, 1)
        denom, acc = fold_sinks(m, denom, acc, sink)
    out = acc / jnp.where(denom > 0, denom, 1.0)  # [nb, kvh, bq * g, d]
    out = out.reshape(nb, kvh, bq, g, d).transpose(0, 2, 1, 3, 4).reshape(nb * bq, h, d)
    result = jnp.zeros((t, h, d), q.dtype)
    return result.at[tok.reshape(-1)].set(out.astype(q.dtype), mode="drop")
