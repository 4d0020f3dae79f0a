"""The CPU quantized-matmul kernel: numba loops over blocks of 4 weight rows, their inner loops written as LLVM IR
on 16-float vectors.

A decode step (one input row) dequantizes each chunk of 16 weights in registers and feeds it straight into the
dot product, 4 rows sharing each input load; a step with more rows (batches, prefill chunks) dequantizes the rows a
thread owns into a float32 buffer once and multiplies them by the inputs in L2-sized blocks, 4 rows by 2 inputs a
pass. Memory traffic is the packed weights (4.5-8.5 bits a value instead of 32). Both paths run the same
operations in the same order (see the IR section), so a row's result does not depend on how many rows the step
has or how they are split between threads (batch invariance)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import (  # noqa: E402 (after the stale-cache check)
    F16,
    HANDLER,
    U8,
    buffer,
    buffer_dtype,
    dim,
    export_symbol,
    ir_fma16,
    ir_for,
    ir_hsum,
    is_execute,
    keep_alive,
    launch,
    load32,
    load64,
    prefetch_l2,
    symbol,
    to_int,
    to_ptr,
)

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)


# -- the inner loops, as LLVM IR on explicit 16-float vectors
# Each weight row is read in pairs of 16-value chunks: chunk 2p accumulates into one vector, chunk 2p + 1 into
# another, both with llvm.fma (one rounding, no fast-math reassociation); the two vectors are added and summed by
# a fixed tree at the end. A value of W is fma(q, scale, offset) (offset -8 * scale for symmetric 4-bit data, so
# (q - 8) * scale exactly). The decode path (one input row) dequantizes chunks in registers; the batched path
# dequantizes a block of rows into a float32 buffer once and dots each input row with it; both run these exact
# operations in this order, so every output is bit-identical whichever path, batch size or thread computes it.
_F32, _I8, _I16, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(64)
_V = ir.VectorType(_F32, 16)
_VI8 = ir.VectorType(_I8, 16)


def _at(b, addr, ty, offset=0):
    """A pointer to `ty` at addr + offset (offset: a Python int or an i64 value)."""
    if not isinstance(offset, int):
        addr = b.add(addr, offset)
    elif offset:
        addr = b.add(addr, ir.Constant(_I64, offset))
    return b.inttoptr(addr, ty.as_pointer())


def _load(b, addr, ty, offset=0):
    return b.load(_at(b, addr, ty, offset), align=1 if ty in (_VI8, _I8, _I16) else 4)


def _splat(b, v):
    vec = b.insert_element(ir.Constant(_V, None), v, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(vec, ir.Constant(_V, None), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _scalar(b, addr, half):
    """The scale (or offset) at addr: float16 bits or float32 -> float."""
    if half:
        return b.fpext(b.bitcast(_load(b, addr, _I16), ir.HalfType()), _F32)
    return _load(b, addr, _F32)


def _chunk_pair(b, bits, half, affine, data, scale, offset, p, group, shared=False):
    """Values of chunks 2p and 2p + 1 of one row (two <16 x float>). data/scale/offset: the row's addresses;
    group: log2 of the values per scale, 63 for one scale per row (8-bit; 4-bit data has one scale per pair).
    shared: the caller knows group >= 5 (the pair has one scale: loaded and converted once)."""
    size = 2 if half else 4
    if bits == 4:
        raw = _load(b, data, _VI8, b.mul(p, ir.Constant(_I64, 16)))
        q0 = b.uitofp(b.and_(raw, ir.Constant(_VI8, [15] * 16)), _V)
        q1 = b.uitofp(b.lshr(raw, ir.Constant(_VI8, [4] * 16)), _V)
        idx = (p, p)
    else:
        at = b.mul(p, ir.Constant(_I64, 32))
        q0 = b.sitofp(_load(b, data, _VI8, at), _V)
        q1 = b.sitofp(_load(b, data, _VI8, b.add(at, ir.Constant(_I64, 16))), _V)
        first = b.lshr(at, group)
        idx = (first, first) if shared else (first, b.lshr(b.add(at, ir.Constant(_I64, 16)), group))
    out = []
    for q, g in zip((q0, q1), idx, strict=True):
        if affine:
            sc, off = _vector_at(b, scale, g, size, half), _vector_at(b, offset, g, size, half)
        elif bits == 4:
            sc = _vector_at(b, scale, g, size, half)
            off = b.fmul(sc, ir.Constant(_V, [-8.0] * 16))
        else:
            sc, off = _vector_at(b, scale, g, size, half), ir.Constant(_V, [0.0] * 16)
        out.append(ir_fma16(b, q, sc, off))
    return out


def _vector_at(b, base, index, size, half):
    """The scale (or offset) at `index`, in all 16 lanes: a float16 is broadcast, then converted as a vector (a
    broadcast load and one conversion, not a scalar load, conversion and broadcast)."""
    if not half:
        return _splat(b, _scalar_at(b, base, index, size, half))
    h16 = ir.VectorType(ir.HalfType(), 16)
    bits = b.bitcast(_load(b, b.add(base, b.mul(index, ir.Constant(_I64, size))), _I16), ir.HalfType())
    vec = b.insert_element(ir.Constant(h16, None), bits, ir.Constant(ir.IntType(32), 0))
    splat = b.shuffle_vector(vec, ir.Constant(h16, None), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
    return b.fpext(splat, _V)


def _scalar_at(b, base, index, size, half):
    return _scalar(b, b.add(base, b.mul(index, ir.Constant(_I64, size))), half)


def _dots(b, rows, x, n, y, chunk_pair, toks=1, x_stride=None, y_stride=None):
    """y[j][k] = sum over n values of row k . input j, for k < rows, j < toks (input j at x + j * x_stride bytes,
    its outputs at y + j * y_stride); chunk_pair(p, k) -> row k's two chunk vectors. Every (row, input) pair
    accumulates in the same order whatever rows and toks are."""
    zero = ir.Constant(_V, [0.0] * 16)
    xs = [x if j == 0 else b.add(x, b.mul(ir.Constant(_I64, j), x_stride)) for j in range(toks)]

    def body(p, accs):
        at = b.mul(p, ir.Constant(_I64, 128))  # 32 floats
        xv = [(_load(b, xj, _V, at), _load(b, xj, _V, b.add(at, ir.Constant(_I64, 64)))) for xj in xs]
        out = list(accs)
        for k in range(rows):
            w0, w1 = chunk_pair(p, k)
            for j, (x0, x1) in enumerate(xv):
                i = 2 * (j * rows + k)
                out[i], out[i + 1] = ir_fma16(b, w0, x0, accs[i]), ir_fma16(b, w1, x1, accs[i + 1])
        return out

    accs = ir_for(b, b.udiv(n, ir.Constant(_I64, 32)), [zero] * (2 * rows * toks), body)
    for j in range(toks):
        yj = y if j == 0 else b.add(y, b.mul(ir.Constant(_I64, j), y_stride))
        for k in range(rows):
            i = 2 * (j * rows + k)
            b.store(ir_hsum(b, b.fadd(accs[i], accs[i + 1])), _at(b, yj, _F32, 4 * k))


def _dot_buffer(rows, toks=1):
    @intrinsic
    def dot(typingctx, w, stride, x, x_stride, n, y, y_stride):
        """y + j * y_stride (float32 [rows]) = rows of float32 w (stride bytes apart) . input j (float32 at
        x + j * x_stride), over n values, for j < toks."""
        def codegen(context, b, sig, args):
            w, stride, x, x_stride, n, y, y_stride = args
            _dots(b, rows, x, n, y, lambda p, k: [
                _load(b, w, _V, b.add(b.mul(ir.Constant(_I64, k), stride), b.add(b.mul(p, ir.Constant(_I64, 128)),
                                                                                ir.Constant(_I64, 64 * j))))
                for j in (0, 1)], toks, x_stride, y_stride)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 7), codegen
    return dot


_dot4_buffer, _dot1_buffer = _dot_buffer(4), _dot_buffer(1)
TOKS = 2  # inputs per pass over a 4-row block: each weight vector loaded from L1 feeds TOKS FMAs
_dot4_buffer_multi = _dot_buffer(4, TOKS)


def _dot_quantized(bits, half, affine, shared=False):
    @intrinsic
    def dot(typingctx, data, data_stride, scale, offset, scale_stride, x, n, group, y):
        """y[0:4] = 4 quantized rows (data/scale/offset row strides in bytes) . x, over n values."""
        def codegen(context, b, sig, args):
            data, data_stride, scale, offset, scale_stride, x, n, group, y = args

            def pair(p, k):
                kk = ir.Constant(_I64, k)
                return _chunk_pair(b, bits, half, affine, b.add(data, b.mul(kk, data_stride)),
                                   b.add(scale, b.mul(kk, scale_stride)), b.add(offset, b.mul(kk, scale_stride)),
                                   p, group, shared)
            _dots(b, 4, x, n, y, pair)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 9), codegen
    return dot


def _dequantize(bits, half, affine):
    @intrinsic
    def dequantize(typingctx, data, scale, offset, n, group, w):
        """w (n float32 at address w) = one quantized row, as the quantized dot computes its values."""
        def codegen(context, b, sig, args):
            data, scale, offset, n, group, w = args

            def body(p, carried):
                w0, w1 = _chunk_pair(b, bits, half, affine, data, scale, offset, p, group)
                at = b.mul(p, ir.Constant(_I64, 128))
                b.store(w0, _at(b, w, _V, at), align=4)
                b.store(w1, _at(b, w, _V, b.add(at, ir.Constant(_I64, 64))), align=4)
                return []
            ir_for(b, b.udiv(n, ir.Constant(_I64, 32)), [], body)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 6), codegen
    return dequantize


PREFETCH_ROWS = 16
X_BLOCK_BYTES = 1 << 18


def _rows(bits, half):
    """The loop over a chunk's output rows for one data layout (4- or 8-bit, float16 or float32 scales)."""
    dot_sym, dot_aff = _dot_quantized(bits, half, False), _dot_quantized(bits, half, True)
    deq_sym, deq_aff = _dequantize(bits, half, False), _dequantize(bits, half, True)
    # 8-bit groups of >= 32 values: one scale a pair (4-bit data always has one: the same functions serve)
    dot_sym_shared, dot_aff_shared = (_dot_quantized(bits, half, False, True), _dot_quantized(bits, half, True, True)) \
        if bits == 8 else (dot_sym, dot_aff)

    def matmul_rows(x, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1):
        """y[:, r0:r1] = x @ dequantize(W)[r0:r1].T (addresses; x [t, n], data [o, p] bytes, scale and offset
        [o, groups] / [o, offset_groups] float16 bits or float32, y [t, o])."""
        size = 2 if half else 4
        group = 63  # log2 of the values per scale (a shift, not a division, per chunk); 63: one scale per row
        if groups > 1:
            group = 0
            while (1 << group) < n // groups:
                group += 1
        affine = offset_groups > 0
        if t == 1:  # decode: dequantized in registers, 4 rows at a time
            r = r0
            while r + 4 <= r1:
                ahead = r + PREFETCH_ROWS  # the hardware prefetcher alone leaves decode latency-bound
                if ahead + 4 <= o:
                    for line in range(data + ahead * p, data + (ahead + 4) * p, 64):
                        prefetch_l2(line)
                    for line in range(scale + ahead * groups * size, scale + (ahead + 4) * groups * size, 64):
                        prefetch_l2(line)
                    for line in range(offset + ahead * offset_groups * size,
                                      offset + (ahead + 4) * offset_groups * size, 64):
                        prefetch_l2(line)
                args = (data + r * p, p, scale + r * groups * size, offset + r * offset_groups * size,
                        groups * size, x, n, group, y + 4 * r)
                if affine:
                    if group > 4:
                        dot_aff_shared(*args)
                    else:
                        dot_aff(*args)
                elif group > 4:
                    dot_sym_shared(*args)
                else:
                    dot_sym(*args)
                r += 4
            start = r
        else:
            start = r0
        if start == r1:
            return
        buf = np.empty((r1 - start, n), np.float32)
        w = buf.ctypes.data
        for k in range(r1 - start):  # every row here (batches; a decode step's last rows) dequantized once
            rk = start + k
            args = (data + rk * p, scale + rk * groups * size, offset + rk * offset_groups * size, n, group,
                    w + 4 * n * k)
            if affine:
                deq_aff(*args)
            else:
                deq_sym(*args)
        block = max(1, X_BLOCK_BYTES // (4 * n))
        for t0 in range(0, t, block):  # input rows in blocks that stay in L2 while every weight row meets them
            t1 = min(t, t0 + block)
            r = start
            while r < r1:
                rows = min(4, r1 - r)
                wr = w + 4 * n * (r - start)
                if rows == 4:
                    tok = t0
                    while tok + TOKS <= t1:
                        _dot4_buffer_multi(wr, 4 * n, x + 4 * n * tok, 4 * n, n, y + 4 * (tok * o + r), 4 * o)
                        tok += TOKS
                    while tok < t1:
                        _dot4_buffer(wr, 4 * n, x + 4 * n * tok, 0, n, y + 4 * (tok * o + r), 0)
                        tok += 1
                else:
                    for tok in range(t0, t1):
                        for k in range(rows):
                            _dot1_buffer(wr + 4 * n * k, 4 * n, x + 4 * n * tok, 0, n, y + 4 * (tok * o + r + k), 0)
                r += rows
        keep_alive(buf)  # written and read through `w` only: freed (and reused by another thread) otherwise
    return matmul_rows


# Module-level functions (one per data layout), so numba caches them.
matmul_rows_q4_f16 = numba.njit(**_KW)(_rows(4, True))
matmul_rows_q4_f32 = numba.njit(**_KW)(_rows(4, False))
matmul_rows_q8_f16 = numba.njit(**_KW)(_rows(8, True))
matmul_rows_q8_f32 = numba.njit(**_KW)(_rows(8, False))


ROWS_PER_CHUNK = 16


@numba.njit(inline="always", **_KW)
def _chunk_args(words, chunk):
    o = load64(words + 56)
    r0 = chunk * ROWS_PER_CHUNK
    return (load64(words), load64(words + 8), load64(words + 16), load64(words + 24), load64(words + 32),
            load64(words + 40), load64(words + 48), o, load64(words + 64), load64(words + 72), load64(words + 80),
            r0, min(o, r0 + ROWS_PER_CHUNK))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q4_f16(words, chunk):
    matmul_rows_q4_f16(*_chunk_args(words, chunk))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q4_f32(words, chunk):
    matmul_rows_q4_f32(*_chunk_args(words, chunk))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q8_f16(words, chunk):
    matmul_rows_q8_f16(*_chunk_args(words, chunk))


@numba.cfunc(types.void(types.int64, types.int64), cache=True)
def _chunk_q8_f32(words, chunk):
    matmul_rows_q8_f32(*_chunk_args(words, chunk))


for _name, _fn in (("q4_f16", _chunk_q4_f16), ("q4_f32", _chunk_q4_f32), ("q8_f16", _chunk_q8_f16),
                   ("q8_f32", _chunk_q8_f32)):
    export_symbol(f"jaxllm_cpu_qmatmul_chunk_{_name}", _fn.address)
_q4_f16 = symbol("jaxllm_cpu_qmatmul_chunk_q4_f16", True)
_q4_f32 = symbol("jaxllm_cpu_qmatmul_chunk_q4_f32", True)
_q8_f16 = symbol("jaxllm_cpu_qmatmul_chunk_q8_f16", True)
_q8_f32 = symbol("jaxllm_cpu_qmatmul_chunk_q8_f32", True)


@numba.njit(**_KW)
def _execute(frame):
    """The FFI call: inputs (x [T, in] f32, data [L, out, in or in / 2] u8/s8, scale [L, out, G] f16 or f32,
    offset [L, out, G or 0] like scale, layer [] s32); output y [T, out] = x @ dequantize(W[layer]).T. The layer
    index is clamped into range, as XLA clamps a dynamic slice's."""
    x_p, x_d = buffer(frame, 0)
    d_p, d_d = buffer(frame, 1)
    s_p, s_d = buffer(frame, 2)
    o_p, o_d = buffer(frame, 3)
    layer_p, _ = buffer(frame, 4)
    y_p, _ = buffer(frame, 0, True)
    t, n = dim(x_d, 0), dim(x_d, 1)
    o, p, groups, offset_groups = dim(d_d, 1), dim(d_d, 2), dim(s_d, 2), dim(o_d, 2)
    layer = min(max(np.int64(load32(layer_p)), 0), dim(d_d, 0) - 1)
    scale_size = 2 if buffer_dtype(frame, 2) == F16 else 4
    d_p += layer * o * p
    s_p += layer * o * groups * scale_size
    o_p += layer * o * offset_groups * scale_size
    four_bit = buffer_dtype(frame, 1) == U8
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
