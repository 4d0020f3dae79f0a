"""Pure-jnp ragged paged attention: the numerical reference, and the fast path on CPU.

Each query token attends to the context of its own sequence. Rather than materialising a
``[T, max_context]`` score matrix, a loop walks the context in blocks of ``kv_block_pages`` pages with an
online softmax: each step gathers, for every token, the block of its own sequence (``[T, block, D]``), so
memory stays ``O(T * block)`` and the loop stops at the longest context in the batch. For decode tokens
this reads each sequence's KV exactly once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: a fully masked row must give exp(-big - -big) = 1 on garbage, not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def token_positions(kv_lens: jax.Array, query_start_loc: jax.Array, num_tokens: int):
    """Per token: its sequence index [T], its absolute position [T], and whether it is a real token [T]."""
    num_seqs = kv_lens.shape[0]
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start_loc[1:], tok, side="right").astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = kv_lens[seq] - q_len + (tok - query_start_loc[seq])
    valid = valid & (kv_lens[seq] > 0)
    return seq, pos, valid


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_block_pages"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, max_pages_per_seq] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_block_pages: int | None = None,
) -> jax.Array:  # [T, num_heads, head_dim]
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    g = h // kvh
    if kv_block_pages is None:
        kv_block_pages = max(1, 128 // page_size)
    max_pages = block_tables.shape[1]
    pad = -max_pages % kv_block_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
    block = kv_block_pages * page_size

    seq, q_pos, valid = token_positions(kv_lens, query_start_loc, t)
    tok_tables = tables[seq]  # [T, padded_max_pages]
    tok_kv_len = jnp.where(valid, kv_lens[seq], 0)  # [T]
    qg = (q.astype(jnp.float32) * sm_scale).reshape(t, kvh, g, d)  # [T, kv_heads, group, D]
    num_blocks = (jnp.max(kv_lens) + block - 1) // block

    def body(j, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tok_tables, j * kv_block_pages, kv_block_pages, axis=1)
        first_pos = j * block + jnp.arange(kv_block_pages) * page_size  # [pages]
        needed = first_pos[None, :] < tok_kv_len[:, None]  # [T, pages]: never touch pages past the context
        pages = jnp.where(needed, pages, k_cache.shape[1])  # out of range -> filled with zeros, not read
        k = jnp.take(k_cache, pages, axis=1, mode="fill", fill_value=0)  # [kv_heads, T, pages, page_size, D]
        v = jnp.take(v_cache, pages, axis=1, mode="fill", fill_value=0)
        k = k.reshape(kvh, t, block, d).astype(jnp.float32)
        v = v.reshape(kvh, t, block, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,ktcd->tkgc", qg, k)  # [T, kv_heads, group, block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * block + jnp.arange(block)
        mask = (kv_pos[None, :] <= q_pos[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * mask[:, None, None, :]
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgc,ktcd->tkgd", p, v)
        return m_new, denom, acc

    init = (jnp.full((t, kvh, g), MASK_VALUE, jnp.float32), jnp.zeros((t, kvh, g), jnp.float32),
            jnp.zeros((t, kvh, g, d), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(t, h, d).astype(q.dtype)
