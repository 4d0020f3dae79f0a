"""The CPU ragged paged attention kernel: a numba loop nest, compiled to machine code, that reads each page in
place.

XLA:CPU runs the jnp reference as "gather the pages into a temporary, then batched matmuls"; for decode the
matmuls are tiny (``group x head_dim`` by ``head_dim x block``) and the gathered copy is written and read
again, so a decode step spends ~3x the KV bytes in memory traffic. This kernel walks each sequence's block
table and folds one page at a time into an online softmax, 8 or 16 query rows at once (`cpu_page_fold`). Work items
are (sequence, KV head, block of query tokens), shared between the calling thread and XLA's thread pool
(`pallas_kernels.cpu_ffi.parallel_for`).

Caches hold float32, float16 or bfloat16 values; 16-bit values are widened to float32 as they are read, a page at
a time (half the bytes a step streams). numba has no 16-bit float types, so the kernel sees 16-bit caches as
integer arrays whose type names the format: uint16 for float16 bits, int16 for bfloat16 bits
(`pallas_kernels.cpu_ffi.widen`). Numerics match the reference (float32 accumulation, the same online-softmax
algebra, the same widened values). Attention sinks (a logit per q head, `NEG` for none) are folded into each row's
softmax once, after its keys (`_with_sink`), as the reference does.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import (  # noqa: E402 (after the stale-cache check)
    BF16,
    ELEMENT_TYPES,
    F16,
    HANDLER,
    buffer,
    buffer_dtype,
    dim,
    export_symbol,
    is_execute,
    keep_alive,
    launch,
    load64,
    prefetch,
    symbol,
    to_int,
    to_ptr,
    widen,
    workers,
)
from pallas_kernels.quantized_matmul.isa import host_features  # noqa: E402
from pallas_kernels.ragged_paged_attention import cpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.cpu_page_fold import (  # noqa: E402
    CHAINS,
    EXP_POLY,
    LANES,
    LN2_HI,
    LN2_LO,
    LOG2E,
    WIDE_LANES,
    fold_scores,
    fold_scores_by_row,
    fold_scores_wide,
    page_scores,
    page_scores_by_row,
    page_scores_wide,
)

NEG = np.float32(cpu.NEG)


# Query rows a vector of the rows layout holds (a prefill chunk's or a speculative step's rows; a decode's take the
# by-row layout): 16 where the host has 512-bit vectors (AVX-512F), half the instructions of 8
ROW_LANES = WIDE_LANES if host_features().get("avx512f", False) else LANES


_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
# The cache element types the kernel is compiled for, by FFI data type: 16-bit formats as integer bit patterns
CACHE_TYPES = ELEMENT_TYPES


@intrinsic
def _float_bits(typingctx, i):
    """The float32 whose bits are the int32 ``i``."""
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@numba.njit(inline="always", **_KW)
def _exp(x):
    """exp(x) for x <= 0 in plain arithmetic (`cpu_page_fold.ir_exp`'s polynomial; ``math.exp`` is a libm call):
    x = n ln2 + r, exp(x) = 2^n exp(r); below -87 it flushes to 0. For the merges and sinks, a row at a time."""
    if x < np.float32(-87.0):
        return np.float32(0.0)
    n = np.floor(x * LOG2E + np.float32(0.5))
    r = x - n * LN2_HI - n * LN2_LO
    c0, c1, c2, c3, c4, c5 = EXP_POLY
    poly = (((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5) * r * r + r + np.float32(1.0)
    return poly * _float_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@numba.njit(inline="always", **_KW)
def _with_sink(m, total, sink):
    """(running max, sum) -> (the sum with one more key of score `sink` and value zero, the factor the unnormalised
    accumulator takes); sink `NEG`: none, (total, 1)."""
    if sink <= NEG:
        return total, np.float32(1.0)
    m_new = max(m, sink)
    alpha = _exp(m - m_new)
    return total * alpha + _exp(sink - m_new), alpha


@numba.njit(inline="always", **_KW)
def _prefetch_page(k_cache, v_cache, kh, page):
    k_addr = np.int64(k_cache[kh, page].ctypes.data)
    v_addr = np.int64(v_cache[kh, page].ctypes.data)
    for line in range(0, k_cache.shape[2] * k_cache.shape[3] * k_cache.itemsize, 64):
        prefetch(k_addr + line)
        prefetch(v_addr + line)


@numba.njit(inline="always", **_KW)
def _widen_page(page, buf, d, visible):
    """buf[:visible, :d] = the page's first ``visible`` rows as float32 (slots past a sequence's length may hold any
    bits and are never read)."""
    for c in range(visible):
        for x in range(d):
            buf[c, x] = widen(page[c, x])


@numba.njit(**_KW)
def attend_block(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, out, sm_scale, window, soft_cap,
                 sinks, block_q, s, kh, b0, g0, g1, lo, hi, slot, partials, row_lanes=ROW_LANES):
    """Query tokens ``b0 .. b0 + block_q`` of sequence ``s``, q heads ``g0 .. g1`` of KV head ``kh``'s group, over
    the keys at positions ``lo .. hi`` (page-aligned), folded page by page into groups of 8 query rows
    (`cpu_page_fold`). slot < 0: the normalised result into ``out``; else the unnormalised accumulator, running max
    and sum into ``partials[slot]`` ([rows, D + 2]) for `merge_chunks`. q, out [T, H, D]; caches [KVH, P, page, D];
    window <= 0 and soft_cap <= 0 mean "none"; sinks [H] (`NEG`: none), folded in here or by `merge_chunks`.
    row_lanes: rows a vector of the rows layout (`LANES` or `WIDE_LANES`; the same bits either way)."""
    h, d = q.shape[1], q.shape[2]
    kvh, _, page_size, _ = k_cache.shape
    group = g1 - g0  # the heads this item computes
    first_head = kh * (h // kvh) + g0
    q0 = query_start_loc[s]
    q_len = query_start_loc[s + 1] - q0
    ctx = kv_lens[s]
    first = ctx - q_len + b0  # position of the block's first query token
    start = max(0, first - window + 1) if window > 0 else 0
    nq = min(block_q, q_len - b0)
    rows = nq * group
    stride = (d + CHAINS - 1) // CHAINS * CHAINS
    # A decode's few rows (<= 8) score the keys and weight the values with lanes along d (`page_scores_by_row`,
    # `fold_scores_by_row`): the queries and the accumulator are then row-major and the keys and values are read
    # from the cache as they are. More rows take lanes as rows, ROW_LANES of them a vector.
    by_row = rows <= LANES and d % LANES == 0
    lanes = LANES if by_row else row_lanes
    groups = (rows + lanes - 1) // lanes
    qt = np.zeros((1, lanes, d) if by_row else (groups, stride, lanes), np.float32)  # pre-scaled queries
    acc = np.zeros((1, lanes, d) if by_row else (groups, stride, lanes), np.float32)
    stats = np.empty((groups, 2, lanes), np.float32)  # running max, sum
    qpos = np.empty((groups, lanes), np.int32)
    low = np.empty((groups, lanes), np.int32)  # a key is visible to a row when low < pos <= qpos
    sc = np.zeros((page_size, lanes), np.float32)  # by row: lanes past the rows stay 0
    widened = 0 if by_row else page_size  # by row, the page is read as it is
    kf = np.zeros((widened, stride), np.float32)
    vf = np.zeros((widened, stride), np.float32)
    for r in range(groups * lanes):
        g, lane = r // lanes, r % lanes
        pos = first + min(r, rows - 1) // group  # padding lanes: the last row's window (their output is dropped)
        qpos[g, lane] = pos
        low[g, lane] = pos - window if window > 0 else -1
        stats[g, 0, lane] = NEG
        stats[g, 1, lane] = 0.0
        if r < rows:
            tok = q0 + b0 + r // group
            head = first_head + r % group
            for x in range(d):
                if by_row:
                    qt[0, r, x] = q[tok, head, x] * sm_scale
                else:
                    qt[g, x, lane] = q[tok, head, x] * sm_scale
    last = first + nq - 1
    end_page = min(last + 1, hi) // page_size + (min(last + 1, hi) % page_size > 0)
    first_page = max(start, lo) // page_size
    if first_page < end_page:
        _prefetch_page(k_cache, v_cache, kh, block_tables[s, first_page])
    sc_p, kf_p, vf_p = np.int64(sc.ctypes.data), np.int64(kf.ctypes.data), np.int64(vf.ctypes.data)
    for pi in range(first_page, end_page):
        page = block_tables[s, pi]
        if pi + 1 < end_page:  # pages are scattered, so the hardware prefetcher cannot guess the next one
            _prefetch_page(k_cache, v_cache, kh, block_tables[s, pi + 1])
        at = pi * page_size
        visible = min(page_size, ctx - at)  # keys past the sequence's length are never read
        if not by_row:
            _widen_page(k_cache[kh, page], kf, d, visible)
            _widen_page(v_cache[kh, page], vf, d, visible)
        for g in range(groups):
            if by_row:
                page_scores_by_row(np.int64(qt[0].ctypes.data), np.int64(k_cache[kh, page].ctypes.data),
                                   k_cache[kh, page, 0, 0], d, visible, rows, sc_p)
            else:
                if lanes == WIDE_LANES:
                    page_scores_wide(np.int64(qt[g].ctypes.data), kf_p, stride, visible, sc_p)
                else:
                    page_scores(np.int64(qt[g].ctypes.data), kf_p, stride, visible, sc_p)
            if soft_cap > 0:
                for c in range(visible):
                    for lane in range(lanes):
                        sc[c, lane] = soft_cap * math.tanh(sc[c, lane] / soft_cap)
            state = (np.int64(stats[g].ctypes.data), np.int64(acc[g].ctypes.data), np.int64(qpos[g].ctypes.data),
                     np.int64(low[g].ctypes.data), np.int64(at))
            if by_row:
                fold_scores_by_row(np.int64(v_cache[kh, page].ctypes.data), v_cache[kh, page, 0, 0], d, visible,
                                   sc_p, *state, rows)
            elif lanes == WIDE_LANES:
                fold_scores_wide(vf_p, stride, visible, sc_p, *state)
            else:
                fold_scores(vf_p, stride, visible, sc_p, *state)
    for r in range(rows):
        g, lane = r // lanes, r % lanes
        if slot >= 0:
            for x in range(d):
                partials[slot, r, x] = acc[0, r, x] if by_row else acc[g, x, lane]
            partials[slot, r, d] = stats[g, 0, lane]
            partials[slot, r, d + 1] = stats[g, 1, lane]
            continue
        tok = q0 + b0 + r // group
        head = first_head + r % group
        total, alpha = _with_sink(stats[g, 0, lane], stats[g, 1, lane], sinks[head])
        inv = alpha / total if total > 0 else np.float32(0.0)
        for x in range(d):
            out[tok, head, x] = (acc[0, r, x] if by_row else acc[g, x, lane]) * inv


@numba.njit(**_KW)
def merge_chunks(partials, merges, q_shape_h, kvh, query_start_loc, block_q, sinks, out):
    """Each split item's chunks (``merges`` rows: sequence, KV head, block start, first and end q head, first slot,
    chunks), combined in chunk order: every output then depends only on its own sequence, never on the batch or
    the threads."""
    d = out.shape[2]
    for i in range(merges.shape[0]):
        s, kh, b0, g0, g1, first_slot, chunks = (merges[i, 0], merges[i, 1], merges[i, 2], merges[i, 3],
                                                  merges[i, 4], merges[i, 5], merges[i, 6])
        group = g1 - g0
        first_head = kh * (q_shape_h // kvh) + g0
        q0 = query_start_loc[s]
        nq = min(block_q, query_start_loc[s + 1] - q0 - b0)
        for r in range(nq * group):
            m = NEG
            for c in range(chunks):
                m = max(m, partials[first_slot + c, r, d])
            total = np.float32(0.0)
            tok = q0 + b0 + r // group
            head = first_head + r % group
            for x in range(d):
                out[tok, head, x] = 0.0
            for c in range(chunks):
                part = partials[first_slot + c]
                if part[r, d + 1] <= 0:
                    continue  # a chunk with no key in this row's window
                w = _exp(part[r, d] - m)
                total += part[r, d + 1] * w
                for x in range(d):
                    out[tok, head, x] += part[r, x] * w
            total, alpha = _with_sink(m, total, sinks[head])
            inv = alpha / total if total > 0 else np.float32(0.0)
            for x in range(d):
                out[tok, head, x] *= inv


@numba.njit(inline="always", **_KW)
def _zero_rows(out, start, end):
    """out[start:end] = 0, as element loops (a slice assignment costs seconds of numba compile)."""
    flat = out.reshape(out.shape[0], -1)
    for r in range(start, end):
        for x in range(flat.shape[1]):
            flat[r, x] = 0.0


CONTEXT_CHUNK = 1024  # key positions an item covers at most: longer contexts split at its multiples


@numba.njit(**_KW)
def plan(kv_lens, query_start_loc, kvh, group, block_q, min_items, page_size, out):
    """The step's work items, (sequence, KV head, first query token of the block, first and end q head of the
    group, first and end key position, partial slot) [n, 8], costliest first so that threads sharing them finish
    together, and the merges of split items [m, 7] (`merge_chunks`). A block whose keys reach past
    ``CONTEXT_CHUNK`` is split at its multiples (flash-decoding: a long context's pages spread over the threads,
    each read once) whatever the batch, so a sequence's numbers never depend on its neighbours. With fewer than
    ``min_items`` items (a lone decoding sequence with fewer KV heads than threads), each is also split by q head,
    so that every thread gets a share (they read the same pages, the second time from cache). Also zeroes the
    output rows no item writes (padding tokens)."""
    num_seqs = kv_lens.shape[0]
    chunk = max(page_size, CONTEXT_CHUNK // page_size * page_size)
    n = 0
    n_split = 0  # blocks split by context
    n_slots = 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        if q_len > 0 and kv_lens[s] > 0:
            for b0 in range(0, q_len, block_q):
                last = kv_lens[s] - q_len + min(b0 + block_q, q_len) - 1
                chunks = last // chunk + 1
                n += chunks * kvh
                if chunks > 1:
                    n_split += kvh
                    n_slots += chunks * kvh
        elif q_len > 0:
            _zero_rows(out, query_start_loc[s], query_start_loc[s + 1])
    _zero_rows(out, max(0, query_start_loc[num_seqs]), out.shape[0])
    split = group if n < min_items else 1
    work = np.empty((n * split, 8), np.int64)
    cost = np.empty(n * split, np.int64)
    merges = np.empty((n_split * split, 7), np.int64)
    i, slot, j = 0, 0, 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        if q_len <= 0 or kv_lens[s] <= 0:
            continue
        for b0 in range(0, q_len, block_q):
            nq = min(block_q, q_len - b0)
            last = kv_lens[s] - q_len + b0 + nq - 1
            chunks = last // chunk + 1
            for kh in range(kvh):
                for part in range(split):
                    g0, g1 = part * group // split, (part + 1) * group // split
                    if chunks > 1:
                        merges[j, 0], merges[j, 1], merges[j, 2], merges[j, 3] = s, kh, b0, g0
                        merges[j, 4], merges[j, 5], merges[j, 6] = g1, slot, chunks
                        j += 1
                    for c in range(chunks):
                        lo, hi = c * chunk, min((c + 1) * chunk, last + 1)
                        work[i, 0], work[i, 1], work[i, 2], work[i, 3], work[i, 4] = s, kh, b0, g0, g1
                        work[i, 5], work[i, 6] = lo, hi
                        work[i, 7] = slot + c if chunks > 1 else -1
                        cost[i] = nq * (hi - lo)  # query rows x keys
                        i += 1
                    if chunks > 1:
                        slot += chunks
    return work[_order_by_cost(cost)], merges, slot


@numba.njit(**_KW)
def _order_by_cost(cost):
    """Indices of `cost` from the largest down, ties in order (insertion sort: a step has at most a few hundred
    items, and numba compiles np.argsort's quicksort for seconds at every cold start)."""
    order = np.arange(cost.shape[0])
    for i in range(1, cost.shape[0]):
        j, item = i, order[i]
        while j > 0 and cost[order[j - 1]] < cost[item]:
            order[j] = order[j - 1]
            j -= 1
        order[j] = item
    return order


@numba.njit(**_KW)
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k, v [T, KVH, D] into the caches [KVH, P, page, D] (the same element type) at flat slots (negative: a
    padding token)."""
    page_size, d = k_cache.shape[2], k_cache.shape[3]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        page, offset = slot // page_size, slot % page_size
        for h in range(k_cache.shape[0]):
            for x in range(d):  # element loops: numba compiles a slice assignment's broadcasting for seconds
                k_cache[h, page, offset, x] = k[t, h, x]
                v_cache[h, page, offset, x] = v[t, h, x]


@numba.njit(**_KW)
def attend_serial(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, out, sm_scale, window, soft_cap,
                  sinks, block_q, min_items=0, row_lanes=ROW_LANES):
    """Every work item on the calling thread (tests, and the reference for the threaded runs); ``min_items``
    as in `plan`, ``row_lanes`` as in `attend_block`."""
    kvh = k_cache.shape[0]
    group = q.shape[1] // kvh
    work, merges, slots = plan(kv_lens, query_start_loc, kvh, group, block_q, min_items, k_cache.shape[2], out)
    partials = np.empty((slots, block_q * group, q.shape[2] + 2), np.float32)
    for i in range(work.shape[0]):
        attend_block(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, out, sm_scale, window, soft_cap,
                     sinks, block_q, work[i, 0], work[i, 1], work[i, 2], work[i, 3], work[i, 4], work[i, 5],
                     work[i, 6], work[i, 7], partials, row_lanes)
    merge_chunks(partials, merges, q.shape[1], kvh, query_start_loc, block_q, sinks, out)


@numba.njit(inline="always", **_KW)
def run_chunk(words, chunk, cache_type):
    """Work item ``chunk`` of a launch over caches of ``cache_type`` (a `CACHE_TYPES` value); the words are the
    addresses of q, the caches, kv_lens, block_tables, query_start_loc, out, the plan and the scalar parameters,
    then T, H, D, KVH, pages, page size, sequences and pages per sequence, then the partials' address and slots,
    then the sinks' address."""
    t, h, d, kvh = load64(words + 72), load64(words + 80), load64(words + 88), load64(words + 96)
    pages, page_size, num_seqs, max_pages = (load64(words + 104), load64(words + 112), load64(words + 120),
                                             load64(words + 128))
    f32, i32 = np.float32, np.int32
    q = carray(to_ptr(load64(words)), (t, h, d), dtype=f32)
    k_cache = carray(to_ptr(load64(words + 8)), (kvh, pages, page_size, d), dtype=cache_type)
    v_cache = carray(to_ptr(load64(words + 16)), (kvh, pages, page_size, d), dtype=cache_type)
    kv_lens = carray(to_ptr(load64(words + 24)), (num_seqs,), dtype=i32)
    block_tables = carray(to_ptr(load64(words + 32)), (num_seqs, max_pages), dtype=i32)
    query_start_loc = carray(to_ptr(load64(words + 40)), (num_seqs + 1,), dtype=i32)
    out = carray(to_ptr(load64(words + 48)), (t, h, d), dtype=f32)
    work = carray(to_ptr(load64(words + 56)), (chunk + 1, 8), dtype=np.int64)
    params = carray(to_ptr(load64(words + 64)), (4,), dtype=f32)  # sm_scale, sliding window, soft cap, block_q
    block_q = np.int64(params[3])
    partials = carray(to_ptr(load64(words + 136)), (max(1, load64(words + 144)), block_q * (h // kvh), d + 2),
                      dtype=f32)
    sinks = carray(to_ptr(load64(words + 152)), (h,), dtype=f32)
    attend_block(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, out, params[0], np.int64(params[1]),
                 params[2], sinks, block_q, work[chunk, 0], work[chunk, 1], work[chunk, 2], work[chunk, 3],
                 work[chunk, 4], work[chunk, 5], work[chunk, 6], work[chunk, 7], partials)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_f32(words, chunk):
    run_chunk(words, chunk, np.float32)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_f16(words, chunk):
    run_chunk(words, chunk, np.uint16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_bf16(words, chunk):
    run_chunk(words, chunk, np.int16)


for _name, _fn in (("f32", _chunk_f32), ("f16", _chunk_f16), ("bf16", _chunk_bf16)):
    export_symbol(f"jaxllm_cpu_ragged_paged_attention_chunk_{_name}", _fn.address)
_chunk_f32_address = symbol("jaxllm_cpu_ragged_paged_attention_chunk_f32", True)
_chunk_f16_address = symbol("jaxllm_cpu_ragged_paged_attention_chunk_f16", True)
_chunk_bf16_address = symbol("jaxllm_cpu_ragged_paged_attention_chunk_bf16", True)


@numba.njit(inline="always", **_KW)
def _write(k_p, v_p, k_new_p, v_new_p, slots_p, t, kvh, pages, page_size, d, cache_type):
    shape, new = (kvh, pages, page_size, d), (t, kvh, d)
    write_kv(carray(to_ptr(k_p), shape, dtype=cache_type), carray(to_ptr(v_p), shape, dtype=cache_type),
             carray(to_ptr(k_new_p), new, dtype=cache_type), carray(to_ptr(v_new_p), new, dtype=cache_type),
             carray(to_ptr(slots_p), (t,), dtype=np.int32))


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (params, q, k, v, slot_mapping, k_cache, v_cache, kv_lens, block_tables,
    query_start_loc, sinks), k/v and the caches of one `CACHE_TYPES` type; outputs (out, k_cache, v_cache), the caches
    aliased to their inputs and updated in place."""
    params_p, _ = buffer(frame, 0)
    q_p, q_d = buffer(frame, 1)
    k_new_p, _ = buffer(frame, 2)
    v_new_p, _ = buffer(frame, 3)
    slots_p, _ = buffer(frame, 4)
    lens_p, lens_d = buffer(frame, 7)
    tables_p, tables_d = buffer(frame, 8)
    starts_p, _ = buffer(frame, 9)
    sinks_p, _ = buffer(frame, 10)
    out_p, _ = buffer(frame, 0, True)
    k_p, k_d = buffer(frame, 1, True)
    v_p, _ = buffer(frame, 2, True)
    t, h, d = dim(q_d, 0), dim(q_d, 1), dim(q_d, 2)
    kvh, pages, page_size = dim(k_d, 0), dim(k_d, 1), dim(k_d, 2)
    num_seqs, max_pages = dim(lens_d, 0), dim(tables_d, 1)
    cache = buffer_dtype(frame, 5)  # the step's K/V (inputs 2, 3) come in the cache's type
    if cache == F16:
        _write(k_p, v_p, k_new_p, v_new_p, slots_p, t, kvh, pages, page_size, d, np.uint16)
        chunk_fn = _chunk_f16_address()
    elif cache == BF16:
        _write(k_p, v_p, k_new_p, v_new_p, slots_p, t, kvh, pages, page_size, d, np.int16)
        chunk_fn = _chunk_bf16_address()
    else:  # F32: `cpu.write_and_attend` passes no other type
        _write(k_p, v_p, k_new_p, v_new_p, slots_p, t, kvh, pages, page_size, d, np.float32)
        chunk_fn = _chunk_f32_address()
    block_q = np.int64(carray(to_ptr(params_p), (4,), dtype=np.float32)[3])
    starts = carray(to_ptr(starts_p), (num_seqs + 1,), dtype=np.int32)
    lens = carray(to_ptr(lens_p), (num_seqs,), dtype=np.int32)
    n = workers()
    # Fewer items than threads (a lone decoding sequence of a model with one KV head): split by q head, so that
    # every thread gets a share. Not for more: each share re-reads its KV head's pages and pays an item's set-up,
    # which cost a lone SmolLM2 decode (3 KV heads) on 2 cores more than its uneven 3 items do
    # (`benchmarks/attention.py --decode-one`; figures in docs/performance.md).
    min_items = n if n > 1 else 0
    out = carray(to_ptr(out_p), (t, h, d), dtype=np.float32)
    work, merges, slots = plan(lens, starts, kvh, h // kvh, block_q, min_items, page_size, out)
    partials = np.empty((max(1, slots), block_q * (h // kvh), d + 2), np.float32)
    launch(frame, (q_p, k_p, v_p, lens_p, tables_p, starts_p, out_p, np.int64(work.ctypes.data), params_p, t, h, d,
                   kvh, pages, page_size, num_seqs, max_pages, np.int64(partials.ctypes.data), slots, sinks_p),
           work.shape[0], chunk_fn, False)
    merge_chunks(partials, merges, h, kvh, starts, block_q, carray(to_ptr(sinks_p), (h,), dtype=np.float32), out)
    keep_alive(work)  # the chunks read it through its address
    keep_alive(partials)


@numba.cfunc(HANDLER, cache=True)
def handler(frame_ptr):
    """The XLA:CPU FFI handler (``pallas_kernels.cpu_ffi.HANDLER``)."""
    frame = to_int(frame_ptr)
    if is_execute(frame):
        _execute(frame)
    return to_ptr(0)
