"""The int8-activation quantized matmul with the adapter term in the same call (`cpu_int8_kernel`'s handler and
`cpu_kernel`'s two passes, in the matmul's two launches): ``y = x W^T + (x A_s^T) B_s^T`` for each token's slot s.

- The first pass (``u = A_s x``) is the matmul launch's first chunk: the calling thread runs it while a helper
  starts on the matmul's rows. A step too big for one chunk runs it in the quantizing launch instead, by blocks of
  A's rows (`cpu_kernel.a_rows`), shared.
- The second pass's blocks of outputs (`cpu_kernel.b_rows`) follow the matmul's chunks in the same launch, each
  after the first pass is done (`first_pass_done`), into a scratch term; the calling thread then adds the term to
  the output, one rounding an output: the bits XLA's addition of the two kernels' results gives.

A decode step of a single stream with an adapter makes 4 custom calls a layer instead of 8: its first pass overlaps
the helper's matmul rows and its second is shared by both threads, where the separate kernel ran both on the
calling thread alone (measured against the two calls: docs/performance.md, "The adapter's term in the matmul's
call")."""

from __future__ import annotations

import functools

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
    call_chunk,
    compare_and_swap,
    export_symbol,
    fetch_add,
    is_execute,
    keep_alive,
    launch,
    load64,
    load_acquire,
    spin_pause,
    symbol,
    to_int,
    to_ptr,
)
from pallas_kernels.lora_delta.cpu_kernel import (  # noqa: E402
    ROWS_PER_CHUNK as A_ROWS_PER_CHUNK,
)
from pallas_kernels.lora_delta.cpu_kernel import (  # noqa: E402
    TOKENS_PER_CHUNK,
    _arrays,
    a_block,
    a_rows,
    b_rows,
    call_words,
)
from pallas_kernels.quantized_matmul import isa as isa_mod  # noqa: E402
from pallas_kernels.quantized_matmul.cpu_int8_kernel import (  # noqa: E402
    QUANTIZE_ROWS,
    ROWS_PER_CHUNK,
    _chunk_symbols,
    _pick,
    _quantize_chunk_fn,
    layer_operands,
)

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
SERIAL_A_MACS = 1 << 16  # a first pass of at most so many multiply-adds is the matmul launch's first chunk
# launch words: the matmul's (`cpu_int8_kernel._build`: 15), then these
LORA_WORDS, BASE_CHUNK = 15, 16  # the address of the term's words (`cpu_kernel.call_words`), the matmul's chunk
Q_LORA_WORDS, Q_CHUNKS = 7, 8  # the quantizing launch's: after its 7, the term's words and its chunk count
U_STATE = 15  # the term's words, then: the first pass's state (PENDING, RUNNING, DONE)
PENDING, RUNNING, DONE = 0, 1, 2


@numba.njit(**_KW)
def first_pass_done(lora_p, table_type):
    """Returns once u holds the first pass: the thread that finds it pending runs it (whole, on its own), any other
    waits. No thread waits on work that no thread has claimed, so the launch ends whichever thread takes which
    chunk, in whichever order (a task that runs late, or on the caller's thread)."""
    state = lora_p + 8 * U_STATE
    if load_acquire(state) == DONE:
        return
    if compare_and_swap(state, PENDING, RUNNING):
        x, a, _, _, slots, u, _ = _arrays(lora_p, table_type)
        a_block(x, a, slots, u, 0, x.shape[0], 0, a.shape[1])
        fetch_add(state, DONE - RUNNING)
        return
    while load_acquire(state) != DONE:
        spin_pause()


@numba.njit(inline="always", **_KW)
def _matmul_chunk(words, c, table_type):
    """The matmul launch's chunk c: 0 the first pass (unless the quantizing launch ran it), then the matmul's
    chunks (16 output rows for every token), then blocks of outputs of the adapter term (`cpu_kernel.b_rows`, into
    the term's scratch; each waits for the first pass)."""
    lora_p = load64(words + 8 * LORA_WORDS)
    rows = (load64(words + 72) + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    if c == 0:
        first_pass_done(lora_p, table_type)
    elif c <= rows:
        call_chunk(load64(words + 8 * BASE_CHUNK), words, c - 1)
    else:
        first_pass_done(lora_p, table_type)
        b_rows(lora_p, c - 1 - rows, table_type)


@numba.njit(**_KW)
def add_term(y_p, d_p, t, o):
    """y += d, both [t, o] float32 (one rounding an output: the same as XLA adding the separate kernels' results)."""
    y = carray(to_ptr(y_p), (t * o,), dtype=np.float32)
    d = carray(to_ptr(d_p), (t * o,), dtype=np.float32)
    for i in range(t * o):
        y[i] += d[i]


@numba.njit(inline="always", **_KW)
def _quantize_or_a_chunk(words, c, table_type):
    """The quantizing launch's chunk c: the inputs' rows to int8, or past them a block of the first pass."""
    quantizing = load64(words + 8 * Q_CHUNKS)
    if c < quantizing:
        call_chunk(_quantize_chunk_fn(), words, c)
    else:
        a_rows(load64(words + 8 * Q_LORA_WORDS), c - quantizing, table_type)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _matmul_f32(words, c):
    _matmul_chunk(words, c, np.float32)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _matmul_f16(words, c):
    _matmul_chunk(words, c, np.uint16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _matmul_bf16(words, c):
    _matmul_chunk(words, c, np.int16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _quantize_f32(words, c):
    _quantize_or_a_chunk(words, c, np.float32)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _quantize_f16(words, c):
    _quantize_or_a_chunk(words, c, np.uint16)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _quantize_bf16(words, c):
    _quantize_or_a_chunk(words, c, np.int16)


for _name, _fn in (("matmul_f32", _matmul_f32), ("matmul_f16", _matmul_f16), ("matmul_bf16", _matmul_bf16),
                   ("quantize_f32", _quantize_f32), ("quantize_f16", _quantize_f16),
                   ("quantize_bf16", _quantize_bf16)):
    export_symbol(f"jaxllm_cpu_lora_fused_{_name}_chunk", _fn.address)
_matmul_f32_fn = symbol("jaxllm_cpu_lora_fused_matmul_f32_chunk", True)
_matmul_f16_fn = symbol("jaxllm_cpu_lora_fused_matmul_f16_chunk", True)
_matmul_bf16_fn = symbol("jaxllm_cpu_lora_fused_matmul_bf16_chunk", True)
_quantize_f32_fn = symbol("jaxllm_cpu_lora_fused_quantize_f32_chunk", True)
_quantize_f16_fn = symbol("jaxllm_cpu_lora_fused_quantize_f16_chunk", True)
_quantize_bf16_fn = symbol("jaxllm_cpu_lora_fused_quantize_bf16_chunk", True)


@numba.njit(inline="always", **_KW)
def _quantize(frame, lora, lora_p, quantize_words, quantize_fn):
    """Quantizes the inputs; a first pass too big for one chunk of the matmul launch runs in the same launch,
    shared (its state then DONE)."""
    t, n, w = lora[7], lora[8], lora[9]
    quantizing = (t + QUANTIZE_ROWS - 1) // QUANTIZE_ROWS
    lora[U_STATE] = PENDING
    if t * w * n <= SERIAL_A_MACS:
        launch(frame, quantize_words, quantizing, _quantize_chunk_fn(), True)
    else:
        blocks = ((t + TOKENS_PER_CHUNK - 1) // TOKENS_PER_CHUNK) * ((w + A_ROWS_PER_CHUNK - 1) // A_ROWS_PER_CHUNK)
        launch(frame, quantize_words + (lora_p, quantizing), quantizing + blocks, quantize_fn, True)
        lora[U_STATE] = DONE


@functools.cache
def handler(isa: str, interleaved: bool = False):
    """The FFI handler of `isa`'s path (interleaved: weights interleaved by 16 rows, `cpu_x16_kernel`), built (or
    loaded from numba's disk cache) on first use."""
    from pallas_kernels.quantized_matmul.cpu import X16_ISAS
    if not isa_mod.supported(isa) or (interleaved and isa not in X16_ISAS):
        raise ValueError(f"no {'interleaved ' if interleaved else ''}{isa} path here ({isa_mod.describe()})")
    q4_f16, q4_f32, q8_f16, q8_f32 = _chunk_symbols(isa, interleaved=interleaved)

    def ffi_handler(frame_ptr):
        """Inputs: the matmul's (x [T, in] f32, data, scale, offset, layer: `cpu_int8_kernel.handler`'s), then the
        term's (a [L, S, P * R, in], b [L, S, R, out] (f32, f16 or bf16), layer [] s32, slots [T] s32, parts: as
        `cpu_kernel`'s); outputs y [T, out] f32, the int8 blocks' scratch (xq, xd, xs), u [T, P * R] and the term
        d [T, out] f32 (scratch)."""
        frame = to_int(frame_ptr)
        if is_execute(frame):
            (x_p, w_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, t, n, o, p, groups, offset_groups, scale_size,
             four_bit) = layer_operands(frame)
            tables = buffer_dtype(frame, 5)
            lora = np.empty(U_STATE + 1, np.int64)
            d_p = buffer(frame, 5, True)[0]
            words = call_words(frame, 5, d_p, buffer(frame, 4, True)[0], 4 if tables != F16 and tables != BF16
                               else 2)
            for i in range(15):
                lora[i] = words[i]
            lora_p = np.int64(lora.ctypes.data)
            sums = np.empty((t, n // 32), np.int32)
            sums_p = np.int64(sums.ctypes.data)
            quantize_words = (x_p, xq_p, xd_p, xs_p, t, n, sums_p)
            if tables == F16:
                _quantize(frame, lora, lora_p, quantize_words, _quantize_f16_fn())
                term = _matmul_f16_fn()
            elif tables == BF16:
                _quantize(frame, lora, lora_p, quantize_words, _quantize_bf16_fn())
                term = _matmul_bf16_fn()
            else:
                _quantize(frame, lora, lora_p, quantize_words, _quantize_f32_fn())
                term = _matmul_f32_fn()
            fn = _pick(four_bit, scale_size, q4_f16(), q4_f32(), q8_f16(), q8_f32())
            per = lora[14]  # the term's outputs a chunk
            launch(frame, (xq_p, xd_p, xs_p, w_p, s_p, o_p, y_p, t, n, o, p, groups, offset_groups, 0, sums_p, lora_p,
                           fn), 1 + (o + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK + (o + per - 1) // per, term, True)
            add_term(y_p, d_p, t, o)
            keep_alive(sums)
            keep_alive(lora)
        return to_ptr(0)
    return numba.cfunc(HANDLER, **_CACHE)(ffi_handler)


_CACHE = dict(cache=True, error_model="numpy", boundscheck=False)
