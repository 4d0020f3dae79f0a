"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Grid: (kv_heads, query blocks). Block tables, context lengths, query offsets and each block's sequence
range are scalar-prefetched into SMEM. A program holds its block's queries for one KV head as a
``[block_q * group, head_dim]`` VMEM tile (all q heads sharing that KV head, so K/V are read once for the
group), walks the sequences in its block, and for each streams that sequence's pages from HBM into a
double-buffered VMEM scratch with async DMA (page j + 1 is in flight while page j is used), folding each page
into an online softmax. Only pages holding positions the block's tokens may attend to are copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.blocks import DEFAULT_BLOCK_Q, block_seq_ranges
from pallas_kernels.ragged_paged_attention.reference import MASK_VALUE, fold_sinks


def _kernel(kv_lens_ref, tables_ref, qsl_ref, first_ref, last_ref, window_ref,  # scalar prefetch (SMEM)
            q_ref, k_hbm, v_hbm,  # q: [rows, D] VMEM; k/v: [kv_heads, pages, page_size, D] HBM
            *refs,  # with sinks, their [rows, 1] VMEM (each row's head's); then o_ref [rows, D]; then the scratch:
            # k_buf, v_buf [2, page_size, D] VMEM, DMA semaphores [2, 2]
            group: int, block_q: int, max_pages: int, sm_scale: float, windowed: bool, soft_cap: float | None,
            sinks: bool):
    sink_ref, (o_ref, k_buf, v_buf, sems) = (refs[0], refs[1:]) if sinks else (None, refs)
    h, b = pl.program_id(0), pl.program_id(1)
    rows, d = q_ref.shape
    page_size = k_buf.shape[1]
    q = q_ref[...].astype(jnp.float32) * sm_scale
    # Integer division via lax.div: operands are non-negative, and jnp's floor division needs the TPU
    # generation at lowering time.
    tok = b * block_q + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)  # [rows, 1]

    def copies(s, j, slot):
        page = tables_ref[s * max_pages + j]
        return (pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot], sems.at[1, slot]))

    def seq_body(s, carry):
        q_start, q_end, kv_len = qsl_ref[s], qsl_ref[s + 1], kv_lens_ref[s]
        ctx_start = kv_len - (q_end - q_start)  # position of the sequence's first query token
        lo = jnp.maximum(q_start, b * block_q)
        hi = jnp.minimum(q_end, (b + 1) * block_q)  # this block holds tokens [lo, hi) of sequence s
        in_seq = (tok >= q_start) & (tok < q_end)
        q_pos = ctx_start + tok - q_start  # [rows, 1]
        first_page = 0
        if windowed:
            first_page = jax.lax.div(jnp.maximum(ctx_start + lo - q_start - window_ref[0] + 1, 0), page_size)
        num_pages = jnp.where(hi > lo, jax.lax.div(ctx_start + hi - 1 - q_start, page_size) + 1, 0)

        @pl.when(num_pages > first_page)
        def _():
            for c in copies(s, first_page, jax.lax.rem(first_page, 2)):
                c.start()

        def page_body(j, carry):
            m, denom, acc = carry
            slot = jax.lax.rem(j, 2)
            for c in copies(s, j, slot):
                c.wait()

            @pl.when(j + 1 < num_pages)
            def _():
                for c in copies(s, j + 1, 1 - slot):
                    c.start()

            k = k_buf[slot].astype(jnp.float32)  # [page_size, D]
            v = v_buf[slot].astype(jnp.float32)
            scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            k_pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            mask = in_seq & (k_pos <= q_pos)
            if windowed:
                mask &= k_pos > q_pos - window_ref[0]
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(scores - m_new), 0.0)
            alpha = jnp.exp(m - m_new)
            denom = denom * alpha + p.sum(axis=1, keepdims=True)
            acc = acc * alpha + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32)
            return m_new, denom, acc

        return jax.lax.fori_loop(first_page, num_pages, page_body, carry)

    init = (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(first_ref[b], last_ref[b] + 1, seq_body, init)
    if sinks:
        denom, acc = fold_sinks(m, denom, acc, sink_ref[...])
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q", "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, max_pages_per_seq] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # an int, or a traced int32 scalar (per layer)
    soft_cap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    interpret: bool = False,
    sinks: jax.Array | None = None,  # [num_heads]: each q head's sink logit
) -> jax.Array:  # [T, num_heads, head_dim]
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    group = h // kvh
    num_blocks = -(-t // block_q)
    t_pad = num_blocks * block_q
    # [kv_heads, T * group, D]: rows t-major, so a block of block_q tokens is one contiguous tile.
    qk = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0))).reshape(t_pad, kvh, group, d)
    qk = qk.transpose(1, 0, 2, 3).reshape(kvh, t_pad * group, d)
    first, last = block_seq_ranges(query_start_loc, t, block_q)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    rows = block_q * group
    kernel = functools.partial(_kernel, group=group, block_q=block_q, max_pages=block_tables.shape[1],
                               sm_scale=sm_scale, windowed=sliding_window is not None, soft_cap=soft_cap,
                               sinks=sinks is not None)
    extra_specs, extra = [], []
    if sinks is not None:  # each KV head's block rows (token-major, then the group's heads): the same in every block
        extra = [jnp.tile(sinks.astype(jnp.float32).reshape(kvh, 1, group), (1, block_q, 1)).reshape(kvh, rows, 1)]
        extra_specs = [pl.BlockSpec((None, rows, 1), lambda hh, bb, *_: (hh, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(kvh, num_blocks),
            in_specs=[
                pl.BlockSpec((None, rows, d), lambda hh, bb, *_: (hh, bb, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
                *extra_specs,
            ],
            out_specs=pl.BlockSpec((None, rows, d), lambda hh, bb, *_: (hh, bb, 0)),
            scratch_shapes=[
                pltpu.VMEM((2, page_size, d), k_cache.dtype),
                pltpu.VMEM((2, page_size, d), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((kvh, t_pad * group, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, block_tables.reshape(-1), query_start_loc, first, last, window, qk, k_cache, v_cache, *extra)
    out = out.reshape(kvh, t_pad, group, d).transpose(1, 0, 2, 3).reshape(t_pad, h, d)
    return out[:t]
