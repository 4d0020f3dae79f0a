"""The CPU skinny-matmul kernel: a numba loop nest over blocks of 4 weight rows.

Each weight row is read from memory once: the 4 rows (at most 4 x 1536 floats, in L1) are dotted with every
one of the T input rows before moving on, with 4 independent accumulators so the loads stream. Each output
element is one fixed-order (vectorised) dot product of one weight row and one input row, so a row's result
does not depend on T or on how the rows are split between threads."""

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


@numba.njit(inline="always", **_KW)
def _rows4(x, w, y, r):
    n = w.shape[1]
    for tok in range(x.shape[0]):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for i in range(n):
            xi = x[tok, i]
            a0 += w[r, i] * xi
            a1 += w[r + 1, i] * xi
            a2 += w[r + 2, i] * xi
            a3 += w[r + 3, i] * xi
        y[tok, r] = a0
        y[tok, r + 1] = a1
        y[tok, r + 2] = a2
        y[tok, r + 3] = a3


@numba.njit(inline="always", **_KW)
def _row(x, w, y, r):
    for tok in range(x.shape[0]):
        a = np.float32(0.0)
        for i in range(w.shape[1]):
            a += w[r, i] * x[tok, i]
        y[tok, r] = a


@numba.njit(**_KW)
def matmul_rows(x, w, y, r0, r1):
    """y[:, r0:r1] = x @ w[r0:r1].T; x [T, in], w [out, in], y [T, out]; r0 a multiple of 4."""
    r = r0
    while r + 4 <= r1:
        _rows4(x, w, y, r)
        r += 4
    while r < r1:
        _row(x, w, y, r)
        r += 1


# 16 x 576 floats = 37 KB of weights a chunk. Each thread starts on its own half of the rows (parallel_for's
# split), so claims are uncontended and fine chunks only shorten the wait for the slower thread at the end:
# the 121 matmuls of a single-token step took 23.4-24.5 ms with one shared counter over 64-row chunks and
# 21.5-23.5 ms with split ranges of 16-row chunks (alternated runs of a `benchmarks/matmul.py`-like chain).
ROWS_PER_CHUNK = 16


@numba.njit(**_KW)
def run_chunk(words, chunk):
    """One chunk of output rows; the words are (x, w, y addresses, T, in, out)."""
    t, n, o = load64(words + 24), load64(words + 32), load64(words + 40)
    x = carray(to_ptr(load64(words)), (t, n), dtype=np.float32)
    w = carray(to_ptr(load64(words + 8)), (o, n), dtype=np.float32)
    y = carray(to_ptr(load64(words + 16)), (t, o), dtype=np.float32)
    r0 = chunk * ROWS_PER_CHUNK
    matmul_rows(x, w, y, r0, min(o, r0 + ROWS_PER_CHUNK))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk(words, chunk):
    run_chunk(words, chunk)


export_symbol("jaxllm_cpu_skinny_matmul_chunk", _chunk.address)
_chunk_address = symbol("jaxllm_cpu_skinny_matmul_chunk", True)


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (x [T, in], w [layers, out, in], layer [] int32); output y [T, out] = x @ w[layer].T.
    The layer index is clamped into range, as XLA clamps a dynamic slice's."""
    x_p, x_d = buffer(frame, 0)
    w_p, w_d = buffer(frame, 1)
    layer_p, _ = buffer(frame, 2)
    y_p, _ = buffer(frame, 0, True)
    t, n, o = dim(x_d, 0), dim(x_d, 1), dim(w_d, 1)
    layer = min(max(np.int64(load32(layer_p)), 0), dim(w_d, 0) - 1)
    w_p += layer * o * n * 4  # float32
    launch(frame, (x_p, w_p, y_p, t, n, o), (o + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK, _chunk_address(), True)


@numba.cfunc(HANDLER, cache=True)
def handler(frame_ptr):
    """The XLA:CPU FFI handler (``pallas_kernels.cpu_ffi.HANDLER``)."""
    frame = to_int(frame_ptr)
    if is_execute(frame):
        _execute(frame)
    return to_ptr(0)
