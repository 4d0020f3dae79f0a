"""Ragged paged attention as a Pallas GPU kernel (Triton backend).

Grid: (kv_heads, query blocks, KV splits). A program holds its block's queries for one KV head as one
``[block_q * group, head_dim]`` tensor-core tile (the q heads sharing that KV head are stacked as rows, the group
padded to a power of two as Triton requires), walks the sequences in its block and, for each, streams the pages
of its share of the context ``pages_per_iter`` pages per loop iteration (a page of one head is
``page_size * head_dim`` contiguous elements, so each load coalesces, and the iteration's loads are in flight
together), folding each iteration into an online softmax once. With several KV splits (flash-decoding: decode
batches too small to fill the SMs with query blocks alone) each program covers a share of the pages, sized at run
time from the longest context in the step so that short contexts spread over every split too, and writes
unnormalised partials merged afterwards by log-sum-exp; with one split the program normalises and writes the
output itself.

Block sizes are a per-shape decision made when a step is traced (at start-up, once per bucket; never per step):
`block_sizes` reads them from `BLOCK_TABLE` and sizes the splits to fill the device's SMs.

The Triton backend is chosen explicitly with ``triton.CompilerParams``: JAX's Mosaic GPU backend (the
default for ``pallas_call`` on CUDA) is built around TMA/warpgroup pipelines for dense tiles and ships no
paged attention; the Triton lowering also runs on ROCm.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ragged_paged_attention.blocks import block_seq_ranges
from pallas_kernels.ragged_paged_attention.reference import MASK_VALUE, fold_sinks

SM_COUNT = 132  # H100 SXM; the split count only needs the order of magnitude (H200: 132, A100: 108)
MIN_ROWS = 16  # a tensor-core tile's smallest M


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int  # query tokens per program
    tokens_per_iter: int  # KV tokens folded per loop iteration (a whole number of pages, at least one)
    num_warps: int
    num_stages: int
    num_splits: int = 1  # programs along the context, per (KV head, query block)

    def pages_per_iter(self, page_size: int) -> int:
        return max(1, self.tokens_per_iter // page_size)


# (step kind, head_dim) -> block sizes; rows: a program's query rows (block_q tokens x the group's q heads; a tile
# of fewer than MIN_ROWS is padded to MIN_ROWS). Decode: a program per (KV head, block of block_q sequences) with
# MIN_ROWS rows (block_q = MIN_ROWS / group tokens); prefill and mixed steps: 128-row tiles of query
# blocks x 64-token blocks of pages. num_splits is set by `block_sizes`. On an H100 (bf16 cache, head_dim 128,
# 256 sequences x 2048 tokens; `benchmarks/device_check.py`'s sweep, calls queued and rows interleaved) the decode
# row, 4 sequences a program, 64 tokens an iteration, 3 pipeline stages, ran 0.82 ms (78% of HBM bandwidth); every
# row of 64 tokens an iteration (1-4 sequences, 2-3 stages, 2-4 warps) within 2% of it, 4 sequences x 128 tokens
# 14-18% slower. Loading an iteration's pages as one gathered [tokens, head_dim] tile, one dot each for QK and PV,
# was slower in every shape tried (1.22-1.52 ms against 1.12-1.14 for this row, timed one call at a time).
BLOCK_TABLE: dict[tuple[str, int], tuple[int, int, int, int]] = {  # rows, tokens_per_iter, warps, stages
    ("decode", 64): (MIN_ROWS, 128, 4, 2),
    ("decode", 128): (MIN_ROWS, 64, 4, 3),
    ("decode", 256): (MIN_ROWS, 64, 4, 2),
    ("prefill", 64): (128, 64, 4, 2),
    ("prefill", 128): (128, 64, 8, 2),
    ("prefill", 256): (64, 32, 8, 2),
}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def table_key(kind: str, head_dim: int) -> tuple[str, int]:
    """`BLOCK_TABLE`'s key for a step kind ("decode" or "prefill") and head_dim."""
    return kind, min(256, max(64, _pow2(head_dim)))


def block_sizes(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, page_size: int,
                max_pages: int, sm_count: int = SM_COUNT) -> BlockSizes:
    """The block sizes for a step's static shapes: the table's row for (decode or prefill, head_dim), and, for a
    decode step whose grid has fewer than two programs per SM, enough KV splits for about eight (on an H100 at 64
    sequences x 1024 tokens: 8 splits 0.60 ms, 1-4 splits 0.67-0.74 ms, 16 splits 0.89 ms;
    `benchmarks/device_check.py`'s sweep)."""
    kind = "decode" if num_tokens <= num_seqs else "prefill"
    rows, tokens_per_iter, warps, stages = BLOCK_TABLE[table_key(kind, head_dim)]
    # a step of fewer tokens than a block holds: a block of them (no query block of padding tokens to slice off)
    block_q = max(1, min(rows // _pow2(group), _pow2(num_tokens)))
    splits = 1
    programs = num_kv_heads * -(-num_seqs // block_q)
    if kind == "decode" and programs < 2 * sm_count:
        pages_per_iter = max(1, tokens_per_iter // page_size)
        splits = max(1, min(-(-8 * sm_count // programs), max_pages // pages_per_iter, 32))
    return BlockSizes(block_q, tokens_per_iter, warps, stages, splits)


def _kernel(kv_lens_ref, tables_ref, qsl_ref, first_ref, last_ref, split_ref, window_ref, q_ref, k_ref, v_ref,
            *refs, group: int, block_q: int, max_pages: int, pages_per_iter: int, sm_scale: float,
            windowed: bool, soft_cap: float | None, normalise: bool, sinks: bool):
    # refs: with sinks, their [rows] (each row's head's; folded here with one split, by the merge with several),
    # then the outputs
    sink_ref, out_refs = (refs[0], refs[1:]) if sinks else (None, refs)
    b, split = pl.program_id(1), pl.program_id(2)
    rows, d = q_ref.shape  # block_q * group real rows, then padding up to the tile's MIN_ROWS
    page_size = k_ref.shape[1]
    # bf16/f16 caches: both products on the tensor cores in that type, accumulated in float32 (the usual flash
    # attention recipe); float32 caches: IEEE float32 products (Triton's default would be TF32, ~1e-3 relative).
    # Narrower caches (fp8) are widened to bfloat16.
    cdt = k_ref.dtype if k_ref.dtype in (jnp.bfloat16, jnp.float16) else (
        jnp.float32 if k_ref.dtype == jnp.float32 else jnp.bfloat16)
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(cdt)  # [rows, D]
    row = jnp.arange(rows, dtype=jnp.int32)
    tok = b * block_q + row // group  # [rows]
    live = row < block_q * group  # padding rows of a tile wider than the block's queries
    pages_per_split = split_ref[0]  # a multiple of pages_per_iter

    def seq_body(s, carry):
        q_start, q_end, kv_len = qsl_ref[s], qsl_ref[s + 1], kv_lens_ref[s]
        ctx_start = kv_len - (q_end - q_start)
        lo = jnp.maximum(q_start, b * block_q)
        hi = jnp.minimum(q_end, (b + 1) * block_q)
        in_seq = live & (tok >= q_start) & (tok < q_end)
        q_pos = ctx_start + tok - q_start
        first_page = jnp.int32(0)
        if windowed:
            first_page = jnp.maximum(ctx_start + lo - q_start - window_ref[0] + 1, 0) // page_size
            first_page = first_page // pages_per_iter * pages_per_iter  # iterations stay aligned with the split
        num_pages = jnp.where(hi > lo, (ctx_start + hi - 1 - q_start) // page_size + 1, 0)
        start = jnp.maximum(first_page, split * pages_per_split)
        stop = jnp.minimum(num_pages, (split + 1) * pages_per_split)

        def iteration(it, carry):
            m, denom, acc = carry
            j0 = start + it * pages_per_iter
            scores, values = [], []
            for i in range(pages_per_iter):  # the iteration's pages: loads issued together
                j = j0 + i
                page = tables_ref[s * max_pages + jnp.minimum(j, stop - 1)]  # past stop: a page read already
                k = k_ref[page].astype(cdt)  # [page_size, D]
                sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)  # [rows, page_size]
                if soft_cap is not None:
                    sc = soft_cap * jnp.tanh(sc / soft_cap)
                k_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
                mask = in_seq[:, None] & (k_pos[None, :] <= q_pos[:, None]) & (j < stop)
                if windowed:
                    mask &= k_pos[None, :] > q_pos[:, None] - window_ref[0]
                scores.append(jnp.where(mask, sc, MASK_VALUE))
                values.append(v_ref[page].astype(cdt))
            m_new = m
            for sc in scores:
                m_new = jnp.maximum(m_new, sc.max(axis=1))
            alpha = jnp.exp(m - m_new)
            denom, acc = denom * alpha, acc * alpha[:, None]
            for sc, v in zip(scores, values, strict=True):
                p = jnp.where(sc > MASK_VALUE, jnp.exp(sc - m_new[:, None]), 0.0)
                denom = denom + p.sum(axis=1)
                acc = acc + jax.lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())), precision=precision,
                                                preferred_element_type=jnp.float32)
            return m_new, denom, acc

        iterations = jnp.maximum(stop - start, 0) + pages_per_iter - 1
        return jax.lax.fori_loop(0, iterations // pages_per_iter, iteration, carry)

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(first_ref[0 + b], last_ref[0 + b] + 1, seq_body, init)
    if normalise:
        (o_ref,) = out_refs
        if sinks:
            denom, acc = fold_sinks(m[:, None], denom[:, None], acc, sink_ref[...][:, None])
            denom = denom[:, 0]
        o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


def _pad_to_pow2(x: jax.Array) -> jax.Array:
    return jnp.pad(x, (0, _pow2(x.shape[0]) - x.shape[0]))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sizes", "interpret"))
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
    sizes: BlockSizes | None = None,
    interpret: bool = False,
    sinks: jax.Array | None = None,  # [num_heads]: each q head's sink logit
) -> jax.Array:  # [T, num_heads, head_dim]
    """sizes: the block sizes (default: `block_sizes` for these shapes)."""
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    num_seqs, max_pages = block_tables.shape
    for name, n in (("page_size", page_size), ("head_dim", d)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"the GPU kernel needs {name} to be a power of two >= 16, got {n}")
    group = h // kvh
    gp = _pow2(group)
    sizes = sizes or block_sizes(t, num_seqs, kvh, group, d, page_size, max_pages)
    block_q, splits = sizes.block_q, sizes.num_splits
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    pages_per_iter = sizes.pages_per_iter(page_size)
    num_blocks = -(-t // block_q)
    t_pad = num_blocks * block_q
    real = block_q * gp
    rows = max(real, MIN_ROWS)  # a block with fewer query rows than a tile has is padded to one
    qk = jnp.pad(q.reshape(t, kvh, group, d), ((0, t_pad - t), (0, 0), (0, gp - group), (0, 0)))
    qk = qk.transpose(1, 0, 2, 3).reshape(kvh, num_blocks, real, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows - real), (0, 0))).reshape(kvh, num_blocks * rows, d)
    first, last = block_seq_ranges(query_start_loc, t, block_q)
    # Each split's share of the pages, from the longest context in this step, in whole iterations.
    needed = (jnp.max(kv_lens) + page_size - 1) // page_size
    per_split = -(-needed // splits)
    per_split = (per_split + pages_per_iter - 1) // pages_per_iter * pages_per_iter
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)
    ints = [_pad_to_pow2(x.astype(jnp.int32)) for x in
            (kv_lens, block_tables.reshape(-1), query_start_loc, first, last, per_split.reshape(1), window)]
    normalise = splits == 1
    kernel = functools.partial(_kernel, group=gp, block_q=block_q, max_pages=max_pages,
                               pages_per_iter=pages_per_iter, sm_scale=sm_scale,
                               windowed=sliding_window is not None, soft_cap=soft_cap, normalise=normalise,
                               sinks=sinks is not None)
    whole = [pl.BlockSpec(x.shape, lambda hh, bb, ss: (0,)) for x in ints]
    extra_specs, extra = [], []
    if sinks is not None:  # a block's rows (token-major, then the padded group's heads), the same in every block
        row_sinks = jnp.pad(sinks.astype(jnp.float32).reshape(kvh, group), ((0, 0), (0, gp - group)))
        row_sinks = jnp.pad(jnp.tile(row_sinks, (1, block_q)), ((0, 0), (0, rows - real)))  # [kv_heads, rows]
        extra_specs, extra = [pl.BlockSpec((None, rows), lambda hh, bb, ss: (hh, 0))], [row_sinks]
    cache_spec = pl.BlockSpec((None, *k_cache.shape[1:]), lambda hh, bb, ss: (hh, 0, 0, 0))
    if normalise:
        out_specs = [pl.BlockSpec((None, rows, d), lambda hh, bb, ss: (hh, bb, 0))]
        out_shape = [jax.ShapeDtypeStruct((kvh, num_blocks * rows, d), q.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, rows, d), lambda hh, bb, ss: (ss, hh, bb, 0)),
                     pl.BlockSpec((None, None, rows), lambda hh, bb, ss: (ss, hh, bb)),
                     pl.BlockSpec((None, None, rows), lambda hh, bb, ss: (ss, hh, bb))]
        out_shape = [jax.ShapeDtypeStruct((splits, kvh, num_blocks * rows, d), jnp.float32),
                     jax.ShapeDtypeStruct((splits, kvh, num_blocks * rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, kvh, num_blocks * rows), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(kvh, num_blocks, splits),
        in_specs=[*whole, pl.BlockSpec((None, rows, d), lambda hh, bb, ss: (hh, bb, 0)), cache_spec, cache_spec,
                  *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*ints, qk, k_cache, v_cache, *extra)
    if normalise:
        out = outs[0].reshape(kvh, num_blocks, rows, d)[:, :, :real].reshape(kvh, t_pad, gp, d)
    else:
        out = merge_splits(*outs, rows=rows, real=real, out_dtype=q.dtype, interpret=interpret,
                           sinks=extra[0] if extra else None)
        out = out.reshape(kvh, t_pad, gp, d)
    out = out[:, :t, :group].transpose(1, 0, 2, 3).reshape(t, h, d)
    return out.astype(q.dtype)


def _merge_kernel(acc_ref, m_ref, l_ref, *refs, splits: int, sinks: bool):
    # acc_ref [splits, rows, D], m_ref/l_ref [splits, rows] (one (KV head, query block)'s partials); with sinks,
    # their [rows]; o_ref [real, D]: the block's real rows (its first), the tile's padding rows dropped
    sink_ref, (o_ref,) = (refs[0], refs[1:]) if sinks else (None, refs)
    rows, d = o_ref.shape
    real = pl.ds(0, rows)
    m_all = jax.lax.fori_loop(0, splits, lambda s, m: jnp.maximum(m, m_ref[s, real]), m_ref[0, real])

    def add(s, carry):
        denom, acc = carry
        scale = jnp.exp(m_ref[s, real] - m_all)
        return denom + l_ref[s, real] * scale, acc + acc_ref[s, real, :] * scale[:, None]

    denom, acc = jax.lax.fori_loop(0, splits, add, (jnp.zeros((rows,), jnp.float32),
                                                    jnp.zeros((rows, d), jnp.float32)))
    if sinks:
        denom, acc = fold_sinks(m_all[:, None], denom[:, None], acc, sink_ref[real][:, None])
        denom = denom[:, 0]
    o_ref[...] = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(o_ref.dtype)


def merge_splits_reference(acc: jax.Array, m: jax.Array, denom: jax.Array, *, rows: int, real: int, out_dtype,
                           interpret: bool = False, sinks: jax.Array | None = None) -> jax.Array:
    """`merge_splits` in jnp (XLA's reductions)."""
    del interpret
    splits, kvh, total, d = acc.shape
    m_all = m.max(axis=0)
    scale = jnp.exp(m - m_all)  # [splits, kv_heads, blocks * rows]
    denom = (denom * scale).sum(axis=0)[..., None]
    acc = (acc * scale[..., None]).sum(axis=0)
    if sinks is not None:
        sink = jnp.tile(sinks, (1, total // rows))[..., None]  # [kv_heads, blocks * rows, 1]
        denom, acc = fold_sinks(m_all[..., None], denom, acc, sink)
    out = acc / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(kvh, total // rows, rows, d)[:, :, :real].reshape(kvh, -1, d).astype(out_dtype)


def merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, *, rows: int, real: int, out_dtype,
                 interpret: bool = False, sinks: jax.Array | None = None) -> jax.Array:
    """The flash-decoding merge of the splits' partials (acc [splits, kv_heads, blocks * rows, D] unnormalised, m and
    denom [splits, kv_heads, blocks * rows]; each block's first `real` rows are queries): each rescaled to the
    common max, summed in split order, normalised; -> [kv_heads, blocks * real, D]. One program per (KV head,
    query block): one launch where XLA made three reductions and a slice (96 fewer launches in an 8B-shaped batch-1
    step; on an H100, inside the step's CUDA graphs, no faster: `benchmarks/results/device_check_h100_ab.json`).
    sinks [kv_heads, rows]: each tile row's sink logit, folded in after the splits."""
    splits, kvh, total, d = acc.shape
    blocks = total // rows
    part = pl.BlockSpec((splits, None, rows, d), lambda hh, bb: (0, hh, bb, 0))
    stat = pl.BlockSpec((splits, None, rows), lambda hh, bb: (0, hh, bb))
    extra_specs, extra = [], []
    if sinks is not None:
        extra_specs, extra = [pl.BlockSpec((None, rows), lambda hh, bb: (hh, 0))], [sinks]
    return pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, sinks=sinks is not None),
        grid=(kvh, blocks),
        in_specs=[part, stat, stat, *extra_specs],
        out_specs=pl.BlockSpec((None, real, d), lambda hh, bb: (hh, bb, 0)),
        out_shape=jax.ShapeDtypeStruct((kvh, blocks * real, d), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_gpu_merge",
    )(acc, m, denom, *extra)


def pages_walked(query_lens: list[int], kv_lens: list[int], *, num_tokens: int, num_seqs: int, num_kv_heads: int,
                 group: int, head_dim: int, page_size: int, max_pages: int,
                 sliding_window: int | None = None) -> int:
    """How many distinct KV pages (of one KV head, K or V) the kernel's programs read for a step of these
    sequences, summed over its grid (an iteration's repeated last page is not counted: it is a cache hit). What it
    takes from HBM: a model of the kernel's loop bounds, for `benchmarks/gpu_hlo_report.py`, where XLA sees only an
    opaque custom call."""
    sizes = block_sizes(num_tokens, num_seqs, num_kv_heads, group, head_dim, page_size, max_pages)
    block_q, per_iter = sizes.block_q, sizes.pages_per_iter(page_size)
    total, start = 0, 0
    for q, ctx in zip(query_lens, kv_lens, strict=True):
        ctx_start = ctx - q
        for b in range(start // block_q, -(-(start + q) // block_q)):
            lo, hi = max(start, b * block_q), min(start + q, (b + 1) * block_q)
            first = 0
            if sliding_window is not None:
                first = max(ctx_start + lo - start - sliding_window + 1, 0) // page_size // per_iter * per_iter
            total += (ctx_start + hi - 1 - start) // page_size + 1 - first
        start += q
    if start > num_tokens:
        raise ValueError(f"{start} tokens do not fit {num_tokens}")
    return total
