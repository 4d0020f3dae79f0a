"""The CPU adapter-term kernel: two passes over XLA's thread pool, each reading the tables in place (no gathered
copies). First ``u[t] = A[layer, s_t] x[t]`` by blocks of A's rows (every token of the step against the rows of its
own slot: tokens that share an adapter read its rows from cache); then, by blocks of output columns,
``y[t, o] = sum_r u[t, part(o) R + r] B[layer, s_t, r, o]``: with B stored transposed ([R, out]) each rank's term
is one multiply-add over a block's contiguous outputs (a vector loop; gate/up's alternating outputs take each
rank's two coefficients laid out as the parts alternate, and any other block holding several parts of a fused
layer sums each part over the block and keeps each output's own). Summed as 16-long dots per (token, output)
instead, the pass ran at ~1 GMAC/s. A step of a few tokens (a decode step) streams each token's B rows instead
(`b_rows_streamed`), which reads the tables from memory faster. A token without an adapter gets exact zeros.
Each element's sums run in a fixed order over its own token's values, so a token's result does not depend on the
others or on the thread split.
Tables hold float32, float16 or bfloat16 values (the engine's `lora_dtype`); 16-bit values are widened to float32
as they are read (`pallas_kernels.cpu_ffi.widen`): a decode step streams its adapters' tables, half the bytes."""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import (  # noqa: E402 (after the stale-cache check)
    BF16,
    F16,
    HANDLER,
    buffer,
    buffer_dtype,
    dim,
    export_symbol,
    is_execute,
    launch,
    load32,
    load64,
    symbol,
    to_int,
    to_ptr,
    widen,
    workers,
)

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
ROWS_PER_CHUNK = 16  # the first pass's rows of A per chunk
COLS_PER_CHUNK = 64  # the second pass's outputs per chunk: a multiple of 64, so that a chunk of q/k/v (whose
# parts run a head_dim of 64 or more each) holds one part
ALTERNATING_COLS = 256  # the same for a layer whose outputs alternate parts (gate/up): PATTERN's cost spread thinner
PATTERN = 64  # outputs a rank's coefficient pattern covers (alternating parts)
SERIAL_MACS = 1 << 16  # a pass of at most so many multiply-adds runs on the calling thread alone
STREAMED_TOKENS = 4  # a second pass of at most so many tokens streams each token's B rows (`b_rows_streamed`)
STREAM_PATTERN = 512  # outputs a rank's coefficient pattern covers there (alternating parts)
TOKENS_PER_CHUNK = 16  # the first pass's chunks: so many tokens x ROWS_PER_CHUNK of A's rows (a prefill's tokens
# spread over the threads even where A has a single block of rows)


@numba.njit(**_KW)
def a_block(x, a, slots, u, t0, t1, r0, r1):
    """u[t0:t1, r0:r1] = x A[s_t]^T by A's rows r0:r1 (no adapter, or a slot past the table: zeros)."""
    for tok in range(t0, t1):
        s = slots[tok]
        if s < 0 or s >= a.shape[0]:
            for r in range(r0, r1):
                u[tok, r] = np.float32(0.0)
            continue
        for r in range(r0, r1):
            acc = np.float32(0.0)
            for i in range(x.shape[1]):
                acc += widen(a[s, r, i]) * x[tok, i]
            u[tok, r] = acc


@numba.njit(**_KW)
def b_blocks(b, parts_p, alternating, slots, u, y, o0, o1, cols):
    """y[:, o0:o1], by blocks of `cols` outputs: for each token, each part among a block's outputs summed over the
    rank into the block (one scratch for every block: a decode step of one token has ~40 blocks a layer).
    alternating: the outputs alternate parts 0 and 1 (fused gate/up), parts_p is then unused.
    The loops index slices by range variables alone: an index numba cannot prove non-negative gets a wraparound
    test per element, and the loop is no longer vectorized (4x slower)."""
    n_slots, rank = b.shape[0], b.shape[1]
    part = np.empty(cols, np.int32)
    acc = np.empty(cols, np.float32)
    pattern = np.empty(PATTERN, np.float32)
    for start in range(o0, o1, cols):
        stop = min(o1, start + cols)
        n = stop - start
        whole = alternating and n % PATTERN == 0 and start % 2 == 0  # a whole number of patterns, gate first
        first, last = 0, 0
        if alternating and not whole:
            for o in range(n):
                part[o] = (start + o) % 2
            first, last = part[:n].min(), part[:n].max()
        elif parts_p != 0:
            for o in range(n):
                part[o] = load32(parts_p + 4 * (start + o))
            first, last = part[:n].min(), part[:n].max()
        for tok in range(y.shape[0]):
            s = slots[tok]
            row = y[tok, start:stop]
            if s < 0 or s >= n_slots:
                row[:] = np.float32(0.0)
                continue
            block = acc[:n]
            if whole:  # gate, up, gate, up...: each rank's two coefficients laid out as the outputs' parts
                # are, once, for every PATTERN outputs of the block (a pass per part computed each output twice)
                block[:] = np.float32(0.0)
                for r in range(rank):
                    c0, c1 = u[tok, r], u[tok, rank + r]
                    for o in range(PATTERN):
                        pattern[o] = c1 if o & 1 else c0
                    bt = b[s, r, start:stop]
                    for k in range(n // PATTERN):
                        acc_k = block[k * PATTERN:(k + 1) * PATTERN]
                        bt_k = bt[k * PATTERN:(k + 1) * PATTERN]
                        for o in range(PATTERN):
                            acc_k[o] += pattern[o] * widen(bt_k[o])
                row[:] = block
                continue
            for p in range(first, last + 1):
                block[:] = np.float32(0.0)
                for r in range(rank):
                    coef = u[tok, p * rank + r]
                    bt = b[s, r, start:stop]
                    for o in range(n):
                        block[o] += coef * widen(bt[o])
                if first == last:
                    row[:] = block
                else:
                    for o in range(n):
                        if part[o] == p:
                            row[o] = block[o]


@numba.njit(**_KW)
def b_rows_streamed(b, parts_p, alternating, slots, u, y, o0, o1):
    """y[:, o0:o1] for each token rank by rank: the token's B rows are read once each, front to back, one stream
    (`b_blocks` reads a block of every rank's row at once: R streams, which the prefetchers follow poorly when the
    tables come from memory, as a decode step's do), each rank's term added over runs of outputs of one part (a
    row of o or down is one run, q/k/v's a run per head group and part) or, for gate/up's alternating outputs,
    over STREAM_PATTERN outputs at a time (the loops long: per short block, a 64-output loop ran at a third of the
    first pass's rate). Each output sums its rank terms in `b_blocks`' order (from zero, ranks in order), so a
    token's result is the same on either path."""
    n_slots, rank = b.shape[0], b.shape[1]
    out = o1 - o0
    whole = alternating and out % STREAM_PATTERN == 0 and o0 % 2 == 0  # gate, up, ...: a pattern of a rank's two
    part = np.zeros(out, np.int32)  # (the pattern needs none)
    if alternating and not whole:
        for o in range(out):
            part[o] = (o0 + o) % 2
    elif parts_p != 0:
        for o in range(out):
            part[o] = load32(parts_p + 4 * (o0 + o))
    runs = np.empty((max(out, 1), 3), np.int64)  # (start, length, part; -1: each output its own part)
    n_runs = 0
    if alternating and not whole:
        runs[0, 0], runs[0, 1], runs[0, 2] = 0, out, -1
        n_runs = 1
    elif not whole:
        start = 0
        for o in range(1, out + 1):
            if o == out or part[o] != part[start]:
                runs[n_runs, 0], runs[n_runs, 1], runs[n_runs, 2] = start, o - start, part[start]
                n_runs += 1
                start = o
    pattern = np.empty(STREAM_PATTERN, np.float32)
    for tok in range(y.shape[0]):
        s = slots[tok]
        row = y[tok, o0:o1]
        row[:] = np.float32(0.0)
        if s < 0 or s >= n_slots:
            continue
        for r in range(rank):
            bt = b[s, r, o0:o1]
            if whole:
                c0, c1 = u[tok, r], u[tok, rank + r]
                for o in range(STREAM_PATTERN):
                    pattern[o] = c1 if o & 1 else c0
                for k in range(out // STREAM_PATTERN):
                    row_k = row[k * STREAM_PATTERN:(k + 1) * STREAM_PATTERN]
                    bt_k = bt[k * STREAM_PATTERN:(k + 1) * STREAM_PATTERN]
                    for o in range(STREAM_PATTERN):
                        row_k[o] += pattern[o] * widen(bt_k[o])
                continue
            for k in range(n_runs):
                start, n, p = runs[k, 0], runs[k, 1], runs[k, 2]
                row_k = row[start:start + n]
                bt_k = bt[start:start + n]
                if p >= 0:
                    coef = u[tok, p * rank + r]
                    for o in range(n):
                        row_k[o] += coef * widen(bt_k[o])
                else:
                    part_k = part[start:start + n]
                    for o in range(n):
                        row_k[o] += u[tok, part_k[o] * rank + r] * widen(bt_k[o])


@numba.njit(inline="always", **_KW)
def _views(x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count, table_type):
    """The call's arrays from its words (x, a, b, parts, slots, u, y, T, in, P * R, out, R, S; the chunks' words
    then hold the alternating flag), the tables as `table_type` (an `ELEMENT_TYPES` value)."""
    return (carray(to_ptr(x_p), (t, n), dtype=np.float32),
            carray(to_ptr(a_p), (s_count, w, n), dtype=table_type),
            carray(to_ptr(b_p), (s_count, rank, o), dtype=table_type),
            parts_p,
            carray(to_ptr(slots_p), (t,), dtype=np.int32),
            carray(to_ptr(u_p), (t, w), dtype=np.float32),
            carray(to_ptr(y_p), (t, o), dtype=np.float32))


@numba.njit(inline="always", **_KW)
def _arrays(words, table_type):
    """`_views` of the words stored at `words` (by `launch`)."""
    return _views(load64(words), load64(words + 8), load64(words + 16), load64(words + 24), load64(words + 32),
                  load64(words + 40), load64(words + 48), load64(words + 56), load64(words + 64),
                  load64(words + 72), load64(words + 80), load64(words + 88), load64(words + 96), table_type)


@numba.njit(**_KW)
def a_rows(words, chunk, table_type):
    """The first pass's chunk: TOKENS_PER_CHUNK tokens x ROWS_PER_CHUNK rows of A."""
    x, a, _, _, slots, u, _ = _arrays(words, table_type)
    row_blocks = (a.shape[1] + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    r0 = (chunk % row_blocks) * ROWS_PER_CHUNK
    t0 = (chunk // row_blocks) * TOKENS_PER_CHUNK
    a_block(x, a, slots, u, t0, min(x.shape[0], t0 + TOKENS_PER_CHUNK), r0, min(a.shape[1], r0 + ROWS_PER_CHUNK))


@numba.njit(inline="always", **_KW)
def _cols(alternating):
    """The second pass's outputs per block."""
    return ALTERNATING_COLS if alternating else COLS_PER_CHUNK


@numba.njit(**_KW)
def b_rows(words, chunk, table_type):
    """The second pass's chunk: a block of outputs for every token."""
    _, _, b, parts_p, slots, u, y = _arrays(words, table_type)
    alternating = load64(words + 104) != 0
    cols = _cols(alternating)
    streamed = load64(words + 112)  # outputs per chunk of a few tokens' streamed pass, 0: blocked
    if streamed:
        o0 = chunk * streamed
        b_rows_streamed(b, parts_p, alternating, slots, u, y, o0, min(y.shape[1], o0 + streamed))
    else:
        o0 = chunk * cols
        b_blocks(b, parts_p, alternating, slots, u, y, o0, min(y.shape[1], o0 + cols), cols)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _a_chunk_f32(words, chunk):
    a_rows(words, chunk, np.float32)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _a_chunk_f16(words, chunk):
    a_rows(words, chunk, np.uint16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _a_chunk_bf16(words, chunk):
    a_rows(words, chunk, np.int16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _b_chunk_f32(words, chunk):
    b_rows(words, chunk, np.float32)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _b_chunk_f16(words, chunk):
    b_rows(words, chunk, np.uint16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _b_chunk_bf16(words, chunk):
    b_rows(words, chunk, np.int16)


_CHUNKS = (("a_f32", _a_chunk_f32), ("a_f16", _a_chunk_f16), ("a_bf16", _a_chunk_bf16),
           ("b_f32", _b_chunk_f32), ("b_f16", _b_chunk_f16), ("b_bf16", _b_chunk_bf16))
for _name, _fn in _CHUNKS:
    export_symbol(f"jaxllm_cpu_lora_{_name}_chunk", _fn.address)
_a_f32 = symbol("jaxllm_cpu_lora_a_f32_chunk", True)
_a_f16 = symbol("jaxllm_cpu_lora_a_f16_chunk", True)
_a_bf16 = symbol("jaxllm_cpu_lora_a_bf16_chunk", True)
_b_f32 = symbol("jaxllm_cpu_lora_b_f32_chunk", True)
_b_f16 = symbol("jaxllm_cpu_lora_b_f16_chunk", True)
_b_bf16 = symbol("jaxllm_cpu_lora_b_bf16_chunk", True)


@numba.njit(inline="always", **_KW)
def _run(frame, table_type, itemsize, a_chunk, b_chunk):
    """`_execute` for tables of `table_type` (``itemsize`` bytes), its launches' chunks at ``a_chunk`` /
    ``b_chunk``."""
    x_p, x_d = buffer(frame, 0)
    a_p, a_d = buffer(frame, 1)
    b_p, b_d = buffer(frame, 2)
    layer_p, _ = buffer(frame, 3)
    slots_p, _ = buffer(frame, 4)
    parts_p, parts_d = buffer(frame, 5)
    y_p, _ = buffer(frame, 0, True)
    u_p, _ = buffer(frame, 1, True)
    t, n = dim(x_d, 0), dim(x_d, 1)
    s_count, w, rank, o = dim(a_d, 1), dim(a_d, 2), dim(b_d, 2), dim(b_d, 3)
    layer = min(max(np.int64(load32(layer_p)), 0), dim(a_d, 0) - 1)
    a_p += layer * s_count * w * n * itemsize
    b_p += layer * s_count * o * rank * itemsize
    alternating = dim(parts_d, 0) == 2  # (a 2-output layer's own parts would be the same: 0, 1)
    if alternating or dim(parts_d, 0) != o:
        parts_p = 0
    cols = _cols(alternating)
    blocks = (o + cols - 1) // cols
    unit = STREAM_PATTERN if alternating else cols  # a streamed chunk's outputs: whole patterns
    streamed = 0 if t > STREAMED_TOKENS else unit * (((o + unit - 1) // unit + workers() - 1) // workers())
    words = (x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count, np.int64(alternating), streamed)
    x, a, b, _, slots, u, y = _views(x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count,
                                     table_type)
    if t * w * n <= SERIAL_MACS:  # (a decode step's) on this thread: waking the pool would cost more
        a_block(x, a, slots, u, 0, t, 0, w)
    else:
        token_blocks = (t + TOKENS_PER_CHUNK - 1) // TOKENS_PER_CHUNK
        launch(frame, words, token_blocks * ((w + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK), a_chunk, True)
    if t * o * rank <= SERIAL_MACS:
        b_rows_streamed(b, parts_p, alternating, slots, u, y, 0, o)
    elif streamed:
        launch(frame, words, (o + streamed - 1) // streamed, b_chunk, True)
    else:
        launch(frame, words, blocks, b_chunk, True)


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (x [T, in] float32, a [L, S, P * R, in], b [L, S, R, out] (both float32, float16 or
    bfloat16), layer [] int32, slots [T] int32, parts [out] int32: each output's part, [2]: the outputs alternate
    parts 0 and 1 (gate/up), [1]: not fused); outputs y [T, out] float32, u [T, P * R] (scratch). The layer index is
    clamped into range, as XLA clamps a dynamic slice's; a slot past the table is treated as none."""
    tables = buffer_dtype(frame, 1)
    if tables == F16:
        _run(frame, np.uint16, 2, _a_f16(), _b_f16())
    elif tables == BF16:
        _run(frame, np.int16, 2, _a_bf16(), _b_bf16())
    else:  # F32: `cpu.applies` passes no other type
        _run(frame, np.float32, 4, _a_f32(), _b_f32())


@numba.cfunc(HANDLER, cache=True)
def handler(frame_ptr):
    """The XLA:CPU FFI handler (``pallas_kernels.cpu_ffi.HANDLER``)."""
    frame = to_int(frame_ptr)
    if is_execute(frame):
        _execute(frame)
    return to_ptr(0)
