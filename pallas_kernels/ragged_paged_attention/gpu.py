"""Ragged paged attention as a Pallas GPU kernel (Triton backend).

Grid: (kv_heads, query blocks, KV splits). A program holds its block's queries for one KV head as a
``[block_q * group, head_dim]`` tile (q heads sharing that KV head are stacked as rows, padded to a power of
two as Triton requires), walks the sequences in its block and, for each, loads the pages of its share of
the context one page at a time (a page of one head is ``page_size * head_dim`` contiguous elements, so the
loads coalesce), folding them into an online softmax. With several KV splits (decode batches with long
contexts, where query blocks alone leave most SMs idle) each program covers a slice of the pages and
writes unnormalised partials that are merged afterwards by log-sum-exp.

The Triton backend is chosen explicitly with ``triton.CompilerParams``: JAX's Mosaic GPU backend (the
default for ``pallas_call`` on CUDA) is built around TMA/warpgroup pipelines for dense tiles and ships no
paged attention; the Triton lowering also runs on ROCm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.blocks import DEFAULT_BLOCK_Q, block_seq_ranges
from pallas_kernels.ragged_paged_attention.reference import MASK_VALUE


def _kernel(kv_lens_ref, tables_ref, qsl_ref, first_ref, last_ref, q_ref, k_ref, v_ref,
            o_ref, m_ref, l_ref,
            *, group: int, block_q: int, max_pages: int, pages_per_split: int, sm_scale: float,
            sliding_window: int | None, soft_cap: float | None):
    b, split = pl.program_id(1), pl.program_id(2)
    rows, d = q_ref.shape
    page_size = k_ref.shape[1]
    # bf16/f16 caches: both products on the tensor cores in that type, accumulated in float32 (the usual flash
    # attention recipe); float32 caches: IEEE float32 products (Triton's default would be TF32, ~1e-3 relative).
    # Narrower caches (fp8) are widened to bfloat16.
    cdt = k_ref.dtype if k_ref.dtype in (jnp.bfloat16, jnp.float16) else (
        jnp.float32 if k_ref.dtype == jnp.float32 else jnp.bfloat16)
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(cdt)  # [rows, D]
    tok = b * block_q + jnp.arange(rows, dtype=jnp.int32) // group  # [rows]

    def seq_body(s, carry):
        q_start, q_end, kv_len = qsl_ref[s], qsl_ref[s + 1], kv_lens_ref[s]
        ctx_start = kv_len - (q_end - q_start)
        lo = jnp.maximum(q_start, b * block_q)
        hi = jnp.minimum(q_end, (b + 1) * block_q)
        in_seq = (tok >= q_start) & (tok < q_end)
        q_pos = ctx_start + tok - q_start
        first_page = jnp.int32(0)
        if sliding_window is not None:
            first_page = jnp.maximum(ctx_start + lo - q_start - sliding_window + 1, 0) // page_size
        num_pages = jnp.where(hi > lo, (ctx_start + hi - 1 - q_start) // page_size + 1, 0)
        start = jnp.maximum(first_page, split * pages_per_split)
        stop = jnp.minimum(num_pages, (split + 1) * pages_per_split)

        def page_body(j, carry):
            m, denom, acc = carry
            page = tables_ref[s * max_pages + j]
            k = k_ref[page].astype(cdt)  # [page_size, D]
            v = v_ref[page].astype(cdt)
            scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            k_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
            mask = in_seq[:, None] & (k_pos[None, :] <= q_pos[:, None])
            if sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(axis=1))
            p = jnp.where(mask, jnp.exp(scores - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            denom = denom * alpha + p.sum(axis=1)
            acc = acc * alpha[:, None] + jax.lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())),
                                                             precision=precision,
                                                             preferred_element_type=jnp.float32)
            return m_new, denom, acc

        return jax.lax.fori_loop(start, stop, page_body, carry)

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(first_ref[0 + b], last_ref[0 + b] + 1, seq_body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_to_pow2(x: jax.Array) -> jax.Array:
    return jnp.pad(x, (0, _pow2(x.shape[0]) - x.shape[0]))


def default_num_splits(num_tokens: int, num_seqs: int, max_pages: int) -> int:
    """Split the context only for decode-shaped steps (one token per sequence) with long block tables."""
    return max(1, min(8, max_pages // 16)) if num_tokens <= num_seqs else 1


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q", "num_splits",
                                             "interpret", "num_warps", "num_stages"))
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
    block_q: int = DEFAULT_BLOCK_Q,
    num_splits: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [T, num_heads, head_dim]
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    num_seqs, max_pages = block_tables.shape
    for name, n in (("page_size", page_size), ("head_dim", d), ("block_q", block_q)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"the GPU kernel needs {name} to be a power of two >= 16, got {n}")
    group = h // kvh
    gp = _pow2(group)
    num_blocks = -(-t // block_q)
    t_pad = num_blocks * block_q
    rows = block_q * gp
    splits = num_splits or default_num_splits(t, num_seqs, max_pages)
    pages_per_split = -(-max_pages // splits)
    qk = jnp.pad(q.reshape(t, kvh, group, d), ((0, t_pad - t), (0, 0), (0, gp - group), (0, 0)))
    qk = qk.transpose(1, 0, 2, 3).reshape(kvh, t_pad * gp, d)  # [kv_heads, T * group_pow2, D]
    first, last = block_seq_ranges(query_start_loc, t, block_q)
    ints = [_pad_to_pow2(x.astype(jnp.int32)) for x in
            (kv_lens, block_tables.reshape(-1), query_start_loc, first, last)]
    kernel = functools.partial(_kernel, group=gp, block_q=block_q, max_pages=max_pages,
                               pages_per_split=pages_per_split, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap)
    whole = [pl.BlockSpec(x.shape, lambda hh, bb, ss: (0,)) for x in ints]
    cache_spec = pl.BlockSpec((None, *k_cache.shape[1:]), lambda hh, bb, ss: (hh, 0, 0, 0))
    acc, m, denom = pl.pallas_call(
        kernel,
        grid=(kvh, num_blocks, splits),
        in_specs=[*whole, pl.BlockSpec((None, rows, d), lambda hh, bb, ss: (hh, bb, 0)), cache_spec, cache_spec],
        out_specs=[
            pl.BlockSpec((None, None, rows, d), lambda hh, bb, ss: (ss, hh, bb, 0)),
            pl.BlockSpec((None, None, rows), lambda hh, bb, ss: (ss, hh, bb)),
            pl.BlockSpec((None, None, rows), lambda hh, bb, ss: (ss, hh, bb)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, kvh, t_pad * gp, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, kvh, t_pad * gp), jnp.float32),
            jax.ShapeDtypeStruct((splits, kvh, t_pad * gp), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*ints, qk, k_cache, v_cache)
    # Merge the splits: rescale each partial to the common max, then normalise.
    m_all = m.max(axis=0)
    scale = jnp.exp(m - m_all)  # [splits, kv_heads, rows_total]
    denom = (denom * scale).sum(axis=0)
    out = (acc * scale[..., None]).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = out.reshape(kvh, t_pad, gp, d)[:, :t, :group].transpose(1, 0, 2, 3).reshape(t, h, d)
    return out.astype(q.dtype)
