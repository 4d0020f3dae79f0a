"""The CPU adapter-term kernel: two passes over XLA's thread pool, each reading the tables in place (no gathered
copies). First ``u[t] = A[layer, s_t] x[t]`` by blocks of A's rows (every token of the step against the rows of its
own slot: tokens that share an adapter read its rows from cache); then, by blocks of output columns,
``y[t, o] = sum_r u[t, part(o) R + r] B[layer, s_t, r, o]``: with B stored transposed ([R, out]) each rank's term
is one multiply-add over a block's contiguous outputs (a vector loop; gate/up's alternating outputs take each
rank's two coefficients laid out as the parts alternate, and any other block holding several parts of a fused
layer sums each part over the block and keeps each output's own). Summed as 16-long dots per (token, output)
instead, the pass ran at ~1 GMAC/s. A token without an adapter gets exact zeros.
Each element's sums run in a fixed order over its own token's values, so a token's result does not depend on the
others or on the thread split."""

from __future__ import annotations

import numba
import numpy as np
from numba import carray, types

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import (  # noqa: E402 (after the stale-cache check)
    HANDLER,
    buffer,
    dim,
    export_symbol,
    is_execute,
    launch,
    load32,
    load64,
    symbol,
    to_int,
    to_ptr,
)

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
ROWS_PER_CHUNK = 16  # the first pass's rows of A per chunk
COLS_PER_CHUNK = 64  # the second pass's outputs per chunk: a multiple of 64, so that a chunk of q/k/v (whose
# parts run a head_dim of 64 or more each) holds one part
ALTERNATING_COLS = 256  # the same for a layer whose outputs alternate parts (gate/up): PATTERN's cost spread thinner
PATTERN = 64  # outputs a rank's coefficient pattern covers (alternating parts)
SERIAL_MACS = 1 << 16  # a pass of at most so many multiply-adds runs on the calling thread alone
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
                acc += a[s, r, i] * x[tok, i]
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
                            acc_k[o] += pattern[o] * bt_k[o]
                row[:] = block
                continue
            for p in range(first, last + 1):
                block[:] = np.float32(0.0)
                for r in range(rank):
                    coef = u[tok, p * rank + r]
                    bt = b[s, r, start:stop]
                    for o in range(n):
                        block[o] += coef * bt[o]
                if first == last:
                    row[:] = block
                else:
                    for o in range(n):
                        if part[o] == p:
                            row[o] = block[o]


@numba.njit(inline="always", **_KW)
def _views(x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count):
    """The call's arrays from its words (x, a, b, parts, slots, u, y, T, in, P * R, out, R, S; the chunks' words
    then hold the alternating flag)."""
    return (carray(to_ptr(x_p), (t, n), dtype=np.float32),
            carray(to_ptr(a_p), (s_count, w, n), dtype=np.float32),
            carray(to_ptr(b_p), (s_count, rank, o), dtype=np.float32),
            parts_p,
            carray(to_ptr(slots_p), (t,), dtype=np.int32),
            carray(to_ptr(u_p), (t, w), dtype=np.float32),
            carray(to_ptr(y_p), (t, o), dtype=np.float32))


@numba.njit(inline="always", **_KW)
def _arrays(words):
    """`_views` of the words stored at `words` (by `launch`)."""
    return _views(load64(words), load64(words + 8), load64(words + 16), load64(words + 24), load64(words + 32),
                  load64(words + 40), load64(words + 48), load64(words + 56), load64(words + 64),
                  load64(words + 72), load64(words + 80), load64(words + 88), load64(words + 96))


@numba.njit(**_KW)
def a_rows(words, chunk):
    """The first pass's chunk: TOKENS_PER_CHUNK tokens x ROWS_PER_CHUNK rows of A."""
    x, a, _, _, slots, u, _ = _arrays(words)
    row_blocks = (a.shape[1] + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    r0 = (chunk % row_blocks) * ROWS_PER_CHUNK
    t0 = (chunk // row_blocks) * TOKENS_PER_CHUNK
    a_block(x, a, slots, u, t0, min(x.shape[0], t0 + TOKENS_PER_CHUNK), r0, min(a.shape[1], r0 + ROWS_PER_CHUNK))


@numba.njit(inline="always", **_KW)
def _cols(alternating):
    """The second pass's outputs per block."""
    return ALTERNATING_COLS if alternating else COLS_PER_CHUNK


@numba.njit(**_KW)
def b_rows(words, chunk):
    """The second pass's chunk: a block of outputs for every token."""
    _, _, b, parts_p, slots, u, y = _arrays(words)
    alternating = load64(words + 104) != 0
    cols = _cols(alternating)
    o0 = chunk * cols
    b_blocks(b, parts_p, alternating, slots, u, y, o0, min(y.shape[1], o0 + cols), cols)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _a_chunk(words, chunk):
    a_rows(words, chunk)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _b_chunk(words, chunk):
    b_rows(words, chunk)


export_symbol("jaxllm_cpu_lora_a_chunk", _a_chunk.address)
export_symbol("jaxllm_cpu_lora_b_chunk", _b_chunk.address)
_a_address = symbol("jaxllm_cpu_lora_a_chunk", True)
_b_address = symbol("jaxllm_cpu_lora_b_chunk", True)


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (x [T, in], a [L, S, P * R, in], b [L, S, R, out], layer [] int32, slots [T] int32,
    parts [out] int32: each output's part, [2]: the outputs alternate parts 0 and 1 (gate/up), [1]: not fused);
    outputs y [T, out], u [T, P * R] (scratch). The layer index is clamped
    into range, as XLA clamps a dynamic slice's; a slot past the table is treated as none."""
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
    a_p += layer * s_count * w * n * 4  # float32
    b_p += layer * s_count * o * rank * 4
    alternating = dim(parts_d, 0) == 2  # (a 2-output layer's own parts would be the same: 0, 1)
    if alternating or dim(parts_d, 0) != o:
        parts_p = 0
    cols = _cols(alternating)
    words = (x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count, np.int64(alternating))
    x, a, b, _, slots, u, y = _views(x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count)
    if t * w * n <= SERIAL_MACS:  # (a decode step's) on this thread: waking the pool would cost more
        a_block(x, a, slots, u, 0, t, 0, w)
    else:
        token_blocks = (t + TOKENS_PER_CHUNK - 1) // TOKENS_PER_CHUNK
        launch(frame, words, token_blocks * ((w + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK), _a_address(), True)
    if t * o * rank <= SERIAL_MACS:
        b_blocks(b, parts_p, alternating, slots, u, y, 0, o, cols)
    else:
        launch(frame, words, (o + cols - 1) // cols, _b_address(), True)


@numba.cfunc(HANDLER, cache=True)
def handler(frame_ptr):
    """The XLA:CPU FFI handler (``pallas_kernels.cpu_ffi.HANDLER``)."""
    frame = to_int(frame_ptr)
    if is_execute(frame):
        _execute(frame)
    return to_ptr(0)
