"""The CPU quantized-matmul kernel: numba loops over blocks of 4 weight rows.

Each block's rows are dequantized into float32 in L1 (``q * scale + offset``, what the reference computes) and
then dotted with every input row, 4 rows at a time so each input load feeds 4 FMAs, exactly as the float32
skinny kernel does. Memory traffic is the packed weights (4.5-8.5 bits a value instead of 32); each output
element is one fixed-order dot product of one dequantized weight row and one input row, so a row's result does
not depend on how many rows the step has or how they are split between threads (batch invariance)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic, overload

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
GROUP_4BIT = 32
# XLA_FFI_DataType values (xla_data.proto's PrimitiveType) the kernel dispatches on
S8, U8, U16, F32 = 2, 6, 7, 11


@intrinsic
def _half_to_float(typingctx, bits):
    """float16 bits (uint16) -> float32 (one vcvtph2ps with F16C)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def as_float(v):  # float16 bits or float32 -> float32 (numba has no float16 type)
    raise NotImplementedError


@overload(as_float, inline="always")
def _as_float(v):
    if v == types.uint16:
        return lambda v: _half_to_float(v)
    return lambda v: np.float32(v)


@numba.njit(inline="always", **_KW)
def _row_q4(data, scale, offset, r, w, k):
    """w[k] = 4-bit weight row r in float32 (16 bytes per 32-value group, low nibbles first; without offsets the
    values are centred on 8)."""
    affine = offset.shape[1] > 0
    half = data.shape[1] // scale.shape[1]  # 16, read at run time: a loop LLVM vectorizes, not one it unrolls
    for g in range(scale.shape[1]):
        s = as_float(scale[r, g])
        o = as_float(offset[r, g]) if affine else s * np.float32(-8.0)  # symmetric: (q - 8) s, exactly
        src = data[r, g * half:(g + 1) * half]
        low = w[k, 2 * g * half:(2 * g + 1) * half]
        high = w[k, (2 * g + 1) * half:(2 * g + 2) * half]
        for j in range(half):
            # Nibbles split in float32 (exact for 0-255): numba widens integer arithmetic to int64, which
            # vectorizes at half the width.
            b = np.float32(src[j])
            hi = np.floor(b * np.float32(0.0625))
            low[j] = (b - hi * np.float32(16.0)) * s + o
            high[j] = hi * s + o


@numba.njit(inline="always", **_KW)
def _row_q8(data, scale, offset, r, w, k):
    """w[k] = 8-bit weight row r in float32."""
    affine = offset.shape[1] > 0
    groups = scale.shape[1]
    size = data.shape[1] // groups
    for g in range(groups):
        s = as_float(scale[r, g])
        o = as_float(offset[r, g]) if affine else np.float32(0.0)
        for j in range(size):
            w[k, g * size + j] = np.float32(data[r, g * size + j]) * s + o


@numba.njit(inline="always", **_KW)
def _dot4(x, w, y, r):
    """y[:, r:r+4] = x @ w[0:4].T; each input load feeds 4 FMAs."""
    n = w.shape[1]
    for tok in range(x.shape[0]):
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for i in range(n):
            xi = x[tok, i]
            a0 += w[0, i] * xi
            a1 += w[1, i] * xi
            a2 += w[2, i] * xi
            a3 += w[3, i] * xi
        y[tok, r] = a0
        y[tok, r + 1] = a1
        y[tok, r + 2] = a2
        y[tok, r + 3] = a3


@numba.njit(inline="always", **_KW)
def _dot1(x, w, y, r):
    for tok in range(x.shape[0]):
        a = np.float32(0.0)
        for i in range(w.shape[1]):
            a += w[0, i] * x[tok, i]
        y[tok, r] = a


def _rows(row):
    """The loop over output rows, for one way of dequantizing a row (`_row_q4`, `_row_q8`)."""
    def matmul_rows(x, data, scale, offset, y, r0, r1):
        w = np.empty((4, x.shape[1]), np.float32)
        r = r0
        while r + 4 <= r1:
            for k in range(4):
                row(data, scale, offset, r + k, w, k)
            _dot4(x, w, y, r)
            r += 4
        while r < r1:
            row(data, scale, offset, r, w, 0)
            _dot1(x, w[:1], y, r)
            r += 1
    return matmul_rows


# y[:, r0:r1] = x @ dequantize(W)[r0:r1].T. x [T, in]; data [out, in or in / 2]; scale [out, groups]; offset
# [out, groups] or [out, 0] (symmetric); y [T, out]. Two module-level functions, so numba caches them.
matmul_rows_q4 = numba.njit(**_KW)(_rows(_row_q4))
matmul_rows_q8 = numba.njit(**_KW)(_rows(_row_q8))


ROWS_PER_CHUNK = 16


@numba.njit(inline="always", **_KW)
def _chunk_args(words, chunk, data_type, scale_type):
    t, n, o = load64(words + 40), load64(words + 48), load64(words + 56)
    p, groups, offset_groups = load64(words + 64), load64(words + 72), load64(words + 80)
    x = carray(to_ptr(load64(words)), (t, n), dtype=np.float32)
    data = carray(to_ptr(load64(words + 8)), (o, p), dtype=data_type)
    scale = carray(to_ptr(load64(words + 16)), (o, groups), dtype=scale_type)
    offset = carray(to_ptr(load64(words + 24)), (o, offset_groups), dtype=scale_type)
    y = carray(to_ptr(load64(words + 32)), (t, o), dtype=np.float32)
    r0 = chunk * ROWS_PER_CHUNK
    return x, data, scale, offset, y, r0, min(o, r0 + ROWS_PER_CHUNK)


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q4_f16(words, chunk):
    matmul_rows_q4(*_chunk_args(words, chunk, np.uint8, np.uint16))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q4_f32(words, chunk):
    matmul_rows_q4(*_chunk_args(words, chunk, np.uint8, np.float32))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q8_f16(words, chunk):
    matmul_rows_q8(*_chunk_args(words, chunk, np.int8, np.uint16))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q8_f32(words, chunk):
    matmul_rows_q8(*_chunk_args(words, chunk, np.int8, np.float32))


for _name, _fn in (("q4_f16", _chunk_q4_f16), ("q4_f32", _chunk_q4_f32), ("q8_f16", _chunk_q8_f16),
                   ("q8_f32", _chunk_q8_f32)):
    export_symbol(f"jaxllm_cpu_qmatmul_chunk_{_name}", _fn.address)
_q4_f16 = symbol("jaxllm_cpu_qmatmul_chunk_q4_f16", True)
_q4_f32 = symbol("jaxllm_cpu_qmatmul_chunk_q4_f32", True)
_q8_f16 = symbol("jaxllm_cpu_qmatmul_chunk_q8_f16", True)
_q8_f32 = symbol("jaxllm_cpu_qmatmul_chunk_q8_f32", True)


@numba.njit(inline="always")
def _dtype(frame, i):
    """XLA_FFI_Buffer.dtype (+16) of argument i."""
    return load32(load64(load64(frame + 72) + 8 * i) + 16)


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (x [T, in] f32, data [L, out, in or in / 2] u8/s8, scale [L, out, G] u16 (float16
    bits) or f32, offset [L, out, G or 0] like scale, layer [] s32); output y [T, out] = x @ dequantize(W[layer]).T.
    The layer index is clamped into range, as XLA clamps a dynamic slice's."""
    x_p, x_d = buffer(frame, 0)
    d_p, d_d = buffer(frame, 1)
    s_p, s_d = buffer(frame, 2)
    o_p, o_d = buffer(frame, 3)
    layer_p, _ = buffer(frame, 4)
    y_p, _ = buffer(frame, 0, True)
    t, n = dim(x_d, 0), dim(x_d, 1)
    o, p, groups, offset_groups = dim(d_d, 1), dim(d_d, 2), dim(s_d, 2), dim(o_d, 2)
    layer = min(max(np.int64(load32(layer_p)), 0), dim(d_d, 0) - 1)
    scale_size = 2 if _dtype(frame, 2) == U16 else 4
    d_p += layer * o * p
    s_p += layer * o * groups * scale_size
    o_p += layer * o * offset_groups * scale_size
    four_bit = _dtype(frame, 1) == U8
    if four_bit:
        fn = _q4_f16() if scale_size == 2 else _q4_f32()
    else:
        fn = _q8_f16() if scale_size == 2 else _q8_f32()
    launch(frame, (x_p, d_p, s_p, o_p, y_p, t, n, o, p, groups, offset_groups),
           (o + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK, fn, True)


@numba.cfunc(HANDLER, cache=True)
def handler(frame_ptr):
    """The XLA:CPU FFI handler (``pallas_kernels.cpu_ffi.HANDLER``)."""
    frame = to_int(frame_ptr)
    if is_execute(frame):
        _execute(frame)
    return to_ptr(0)
