"""The int8-activation quantized matmul on Intel AMX tiles (`isa` path ``amx``): the same operands, launch and
scratch as `cpu_int8_kernel`'s lane paths, a different inner step.

A chunk of 16 weight rows meets the step's inputs 16 at a time, one 32-value block (16 for GGUF Q6_K's
16-value groups) per tile product:
- A tile: 16 inputs' int8 values of the block (`activations`), read in place from the quantized rows;
- B tile: the 16 weight rows' values of the block, laid out as AMX wants them (4 consecutive values of each row
  side by side, rows across the 64 bytes), unpacked from the weights' own bytes once per block and reused by every
  input tile (`_emit_prepare`); signed 8-bit weights meet the activations by ``tdpbssd``, unsigned 4-bit by
  ``tdpbsud``;
- C tile: each (input, row)'s block sum, an exact int32.
A step of fewer than 16 inputs gets the same sums from AVX-512 VNNI lane passes on B's rows (`_block_sums_lanes`).

The arithmetic, per output (input t, row r): ``acc = fma(float(sum_b), w_scale * x_d, acc)`` block after block
(two sub-blocks in order for 16-value groups), then, for formats with an offset, ``acc = fma(offset_term, x_s,
acc)`` (the block's ``-8 * scale`` for symmetric 4-bit, its offset for affine groups). Every step size runs this,
so a row's result is bit-identical whatever shares its step (batch invariance). The lane paths sum 4 products a
lane and scale lanes, so their results differ from this path's by float32 rounding (both are tested against the
float64 product).

Linux grants a process the AMX tile state only on request (`isa.request_amx`); each chunk loads its tile
configuration (tiles are per thread) and releases the tiles when done.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import ir_fma16, ir_for, stable_key, to_ptr  # noqa: E402 (after the check)
from pallas_kernels.quantized_matmul.cpu_int8_kernel import (  # noqa: E402
    AFFINE,
    COARSE,
    G16,
    G32,
    KINDS,
    NEG8,
    NO_OFFSET,
    ROWS_PER_CHUNK,
    _c,
    _fn,
    _join,
    _load,
    _mask,
    _ptr,
    _splat,
    chunk_setup,
)

_F32, _HALF = ir.FloatType(), ir.HalfType()
_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, 16)
_VI = ir.VectorType(_I32, 16)
_VOID = ir.VoidType()
_BYTES = ir.IntType(8).as_pointer()

TILE = 16  # inputs a tile, weight rows a chunk
TOKENS_PER_PASS = 256  # inputs whose accumulators (64 bytes each) a pass keeps while the weights' blocks stream
SCALE_BLOCKS = 8  # blocks whose scales are unpacked together
SCRATCH_BYTES = 4224 + 64 * TOKENS_PER_PASS  # B, C (2 sub-blocks), row sums, scales, offset terms; accumulators
assert ROWS_PER_CHUNK == TILE
C, A, B = 0, 1, 2  # tile registers: the block sums, the inputs, the weights


def _tile(b, name, *operands):
    args = [ir.Constant(_I8, v) if isinstance(v, int) else v for v in operands]
    return b.call(_fn(b, f"llvm.x86.{name}", _VOID, [a.type for a in args]), args)


@intrinsic
def tile_config(typingctx, m, kbytes):
    """Loads the tile configuration: C m x 16 int32, A m inputs x kbytes, B kbytes / 4 x 64 bytes."""
    def codegen(context, b, sig, args):
        m, kbytes = (b.trunc(a, _I8) for a in args)
        cfg = cgutils.alloca_once(b, ir.ArrayType(_I8, 64))
        b.store(ir.Constant(ir.ArrayType(_I8, 64), [1] + [0] * 63), cfg)
        base = b.ptrtoint(cfg, _I64)
        i16 = ir.IntType(16)

        def put(offset, value, ty):
            b.store(value, _ptr(b, base, ty, offset), align=1)
        for tile, rows, colsb in ((C, m, ir.Constant(i16, 64)), (A, m, b.zext(kbytes, i16)),
                                  (B, b.lshr(kbytes, ir.Constant(_I8, 2)), ir.Constant(i16, 64))):
            put(16 + 2 * tile, colsb, i16)
            put(48 + tile, rows, _I8)
        _tile(b, "ldtilecfg", b.bitcast(cfg, _BYTES))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def scratch(typingctx):
    """The address of SCRATCH_BYTES on the chunk's stack, 64-byte aligned."""
    def codegen(context, b, sig, args):
        slot = cgutils.alloca_once(b, ir.ArrayType(_I8, SCRATCH_BYTES))
        slot.align = 64
        return b.ptrtoint(slot, _I64)
    return types.int64(), codegen


@intrinsic
def copy_row(typingctx, dst, src):
    """16 floats from src (64-byte aligned) to dst: an input's outputs for a whole chunk."""
    def codegen(context, b, sig, args):
        b.store(_load(b, args[1], _V, None, align=64), _ptr(b, args[0], _V), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def tile_release(typingctx):
    def codegen(context, b, sig, args):
        _tile(b, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


def _transpose(b, rows):
    """16 rows of w int32 each (<w x i32>, w 4 or 8) -> w vectors <16 x i32>, vector g = word g of every row."""
    w = rows[0].type.count
    per = 16 // w  # rows a 16-word vector holds
    packed = [_join(b, rows[i:i + per]) for i in range(0, 16, per)]  # element w * i + g: row per*k + i, word g
    out = []
    for g in range(w):
        parts = []
        for k in range(0, len(packed), 2):  # two vectors' word g of each row: 2 * per words
            picks = [s * 16 + w * i + g for s in (0, 1) for i in range(per)]
            parts.append(b.shuffle_vector(packed[k], packed[k + 1], _mask(picks)))
        out.append(_join(b, parts))
    return out


def _row(b, j, rows):
    """Row j of the chunk, or its last row past the matrix's end (those results are never stored)."""
    return b.select(b.icmp_signed("<", _c(j), rows), _c(j), b.sub(rows, _c(1)))


def _row_floats(b, base, stride, rows, index, half):
    """<16 x float>: element j the float (float16 or float32) at base + `_row` j * stride + index * size."""
    size = 2 if half else 4
    v = ir.Constant(_V, None)
    for j in range(TILE):
        x = _load(b, b.add(base, b.mul(_row(b, j, rows), stride)), _HALF if half else _F32, b.mul(index, _c(size)),
                  align=size)
        v = b.insert_element(v, b.fpext(x, _F32) if half else x, ir.Constant(_I32, j))
    return v


def _emit_prepare(b, bits, scale_mode, args):
    """Block `blk` of the chunk's rows -> B (64-byte rows at bbuf) and, for signed 8-bit weights, the lane
    passes' start (wbuf)."""
    data, p, rows, blk, bbuf, wbuf = args
    width = 4 if bits == 4 else 8  # int32 words of a row's block
    words = [_load(b, b.add(data, b.mul(_row(b, j, rows), p)), ir.VectorType(_I32, width), b.mul(blk, _c(4 * width)))
             for j in range(TILE)]
    columns = _transpose(b, words)
    if bits == 4:  # word g of a row: values 4g..4g+3 in the low nibbles, 16 + 4g.. in the high ones
        nibble = ir.Constant(_VI, [0x0F0F0F0F] * 16)
        columns = [b.and_(v, nibble) for v in columns] + [b.and_(b.lshr(v, ir.Constant(_VI, [4] * 16)), nibble)
                                                          for v in columns]
    for g, v in enumerate(columns):
        b.store(v, _ptr(b, bbuf, _VI, 64 * g), align=64)
    if bits == 8:  # the lane pass's start: -128 * each row's sum over a sub-block
        dot = _fn(b, "llvm.x86.avx512.vpdpbusd.512", _VI, [_VI, _VI, _VI])
        ones = ir.Constant(_VI, [0x01010101] * 16)
        subs = 2 if scale_mode == G16 else 1
        for s in range(subs):
            total = ir.Constant(_VI, [0] * 16)
            for v in columns[s * 8 // subs:(s + 1) * 8 // subs]:
                total = b.call(dot, [total, ones, v])
            b.store(b.mul(total, ir.Constant(_VI, [-128] * 16)), _ptr(b, wbuf, _VI, 64 * s), align=64)


def _emit_scales(b, half, scale_mode, off_mode, args):
    """The chunk's rows' scales (sbuf: <16 x float> a sub-block, 2 slots a block) and offset terms (mbuf: one a
    block) for `count` <= SCALE_BLOCKS blocks from blk0: a whole run of G32/G16 scales by one load a row and a
    transpose, others one block at a time."""
    scale, offset, scale_stride, rows, blk0, count, group, sbuf, mbuf = args
    size = 2 if half else 4

    def store(block, sub, v, m=None):  # m: the block's offsets (affine)
        b.store(v, _ptr(b, sbuf, _V, b.mul(b.add(b.mul(block, _c(2)), _c(sub)), _c(64))), align=64)
        if sub == 0 and off_mode != NO_OFFSET:
            m = b.fmul(v, ir.Constant(_V, [-8.0] * 16)) if off_mode == NEG8 else m
            b.store(m, _ptr(b, mbuf, _V, b.mul(block, _c(64))), align=64)

    def one(i, carried):
        blk = b.add(blk0, i)
        if scale_mode == G16:
            for sub in (0, 1):
                store(i, sub, _row_floats(b, scale, scale_stride, rows, b.add(b.mul(blk, _c(2)), _c(sub)), half))
        else:
            index = blk if scale_mode == G32 else b.lshr(b.mul(blk, _c(32)), group)
            store(i, 0, _row_floats(b, scale, scale_stride, rows, index, half),
                  _row_floats(b, offset, scale_stride, rows, index, half) if off_mode == AFFINE else None)
        return []

    if scale_mode == COARSE:
        ir_for(b, count, [], one)
        return
    subs = 2 if scale_mode == G16 else 1
    per_row = SCALE_BLOCKS * subs

    def columns(base):
        """The run's per_row values of every row, as per_row <16 x float> (column i: the run's value i)."""
        rows_v = []
        for j in range(TILE):
            v = _load(b, b.add(base, b.mul(_row(b, j, rows), scale_stride)),
                      ir.VectorType(_HALF if half else _F32, per_row), b.mul(blk0, _c(subs * size)), align=size)
            rows_v.append(b.bitcast(b.fpext(v, ir.VectorType(_F32, per_row)) if half else v,
                                    ir.VectorType(_I32, per_row)))
        out = []
        for h in range(per_row // 8):  # 8 values of every row at a time
            out += _transpose(b, [b.shuffle_vector(v, v, _mask(range(8 * h, 8 * h + 8))) for v in rows_v])
        return [b.bitcast(v, _V) for v in out]

    with b.if_else(b.icmp_signed("==", count, _c(SCALE_BLOCKS))) as (run, blockwise):
        with run:
            offsets = columns(offset) if off_mode == AFFINE else [None] * per_row
            for index, v in enumerate(columns(scale)):
                store(_c(index // subs), index % subs, v, offsets[index])
        with blockwise:
            ir_for(b, count, [], one)


def _block_sums_amx(b, bits, subs, xq, n, bbuf, cbuf):
    """The tile products: C tile s (at cbuf + 1024 s) row k = input k's exact sums over sub-block s, a lane a
    weight row."""
    kbytes = 32 // subs
    dot = "tdpbsud" if bits == 4 else "tdpbssd"  # int8 inputs x unsigned 4-bit / signed 8-bit weights
    for s in range(subs):
        _tile(b, "tileloadd64", A, _ptr(b, xq, _I8, s * kbytes), n)
        _tile(b, "tileloadd64", B, _ptr(b, bbuf, _I8, s * kbytes * 16), _c(64))
        _tile(b, "tilezero", C)
        _tile(b, dot, C, A, B)
        _tile(b, "tilestored64", C, _ptr(b, cbuf, _I8, 1024 * s), _c(64))


def _block_sums_lanes(b, bits, subs, xq, n, bbuf, wbuf, k):
    """The same sums for input k by AVX-512 VNNI on B's rows: its 4 values of a B row broadcast to every lane
    (``vpdpbusd``), a lane a weight row. Signed 8-bit weights meet ``x + 128`` (unsigned) and the lanes start at
    ``-128 * (the rows' sums)`` (`wbuf`): the same integers."""
    dot = _fn(b, "llvm.x86.avx512.vpdpbusd.512", _VI, [_VI, _VI, _VI])
    words = 8 // subs
    out = []
    for s in range(subs):
        chains = [ir.Constant(_VI, [0] * 16)] * 4  # independent accumulators: integer sums, exact in any order
        if bits == 8:
            chains[0] = _load(b, wbuf, _VI, 64 * s, align=64)
        for g in range(s * words, (s + 1) * words):
            word = _load(b, b.add(xq, b.mul(k, n)), _I32, 4 * g, align=4)
            if bits == 8:  # x + 128 a byte (xor on the broadcast vector sends LLVM 22's combiner into a loop)
                word = b.xor(word, ir.Constant(_I32, 0x80808080 - (1 << 32)))
            x = _splat(b, word, _VI)
            w = _load(b, bbuf, _VI, 64 * g, align=64)
            c = g % len(chains)
            chains[c] = b.call(dot, [chains[c], w, x] if bits == 4 else [chains[c], x, w])
        out.append(b.add(b.add(chains[0], chains[1]), b.add(chains[2], chains[3])))
    return out


def _emit_step(b, bits, scale_mode, off_mode, tiles, args):
    """One group of m inputs meets the prepared block: its block sums (tiles: by one AMX tile product, else a
    lane pass per input), then each input k0 <= k < m's accumulator (64 bytes at acc + 64 k) takes the block's
    terms, the same float operations either way."""
    xq, n, bbuf, cbuf, wbuf, sbuf, mbuf, xd, xs, x_stride, acc, k0, m = args
    subs = 2 if scale_mode == G16 else 1
    if tiles:
        _block_sums_amx(b, bits, subs, xq, n, bbuf, cbuf)
    scales = [_load(b, sbuf, _V, 64 * s, align=64) for s in range(subs)]
    offsets = _load(b, mbuf, _V, None, align=64) if off_mode != NO_OFFSET else None

    def body(i, carried):
        k = b.add(k0, i)
        out = b.add(acc, b.mul(k, _c(64)))
        a = _load(b, out, _V, None, align=64)
        d = _splat(b, _load(b, xd, _F32, b.mul(k, x_stride), align=4), _V)
        if tiles:
            sums = [_load(b, cbuf, _VI, b.add(b.mul(k, _c(64)), _c(1024 * s)), align=64) for s in range(subs)]
        else:
            sums = _block_sums_lanes(b, bits, subs, xq, n, bbuf, wbuf, k)
        for s in range(subs):
            a = ir_fma16(b, b.sitofp(sums[s], _V), b.fmul(scales[s], d), a)
        if offsets is not None:
            a = ir_fma16(b, offsets, _splat(b, _load(b, xs, _F32, b.mul(k, x_stride), align=4), _V), a)
        b.store(a, _ptr(b, out, _V), align=64)
        return []
    ir_for(b, b.sub(m, k0), [], body)


def _switch(b, variant, kinds, emit):
    done = b.append_basic_block("amx_done")
    switch = b.switch(variant, done)
    for index, (scale_mode, off_mode) in enumerate(kinds):
        block = b.append_basic_block(f"amx_{index}")
        switch.add_case(index, block)
        b.position_at_end(block)
        emit(scale_mode, off_mode)
        b.branch(done)
    b.position_at_end(done)


def _intrinsics(bits, half):
    kinds = KINDS[bits]

    @intrinsic
    def prepare(typingctx, variant, data, p, rows, blk, bbuf, wbuf):
        def codegen(context, b, sig, args):
            _switch(b, args[0], kinds, lambda sm, om: _emit_prepare(b, bits, sm, args[1:]))
            return context.get_dummy_value()
        return types.void(*[types.int64] * 7), codegen

    @intrinsic
    def scales(typingctx, variant, scale, offset, scale_stride, rows, blk0, count, group, sbuf, mbuf):
        def codegen(context, b, sig, args):
            _switch(b, args[0], kinds, lambda sm, om: _emit_scales(b, half, sm, om, args[1:]))
            return context.get_dummy_value()
        return types.void(*[types.int64] * 10), codegen

    @intrinsic
    def step(typingctx, variant, tiles, xq, n, bbuf, cbuf, wbuf, sbuf, mbuf, xd, xs, x_stride, acc, k0, m):
        def codegen(context, b, sig, args):
            with b.if_else(b.icmp_signed("!=", args[1], _c(0))) as (amx, lanes):
                with amx:
                    _switch(b, args[0], kinds, lambda sm, om: _emit_step(b, bits, sm, om, True, args[2:]))
                with lanes:
                    _switch(b, args[0], kinds, lambda sm, om: _emit_step(b, bits, sm, om, False, args[2:]))
            return context.get_dummy_value()
        return types.void(*[types.int64] * 15), codegen

    return (stable_key(prepare, __name__, "prepare", bits, half),
            stable_key(scales, __name__, "scales", bits, half),
            stable_key(step, __name__, "step", bits, half))


def chunk_fn(bits: int, half: bool, grouped: bool = False):
    """The loop over a chunk's 16 output rows (`cpu_int8_kernel._chunk`'s contract, the same launch words):
    ``chunk(words, c)``, a numba cfunc's body."""
    prepare, scales, step = _intrinsics(bits, half)

    def chunk(words, c):
        (xq, xd, xs, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1, group, mode,
         kind) = chunk_setup(words, c, bits, 2 if half else 4, grouped)
        size = 2 if half else 4
        blocks = n // 32
        rows = r1 - r0
        data, scale, offset = data + r0 * p, scale + r0 * groups * size, offset + r0 * offset_groups * size
        per = min(t, TOKENS_PER_PASS)
        base = scratch()
        bbuf, cbuf, wbuf, sbuf, mbuf, acc = base, base + 512, base + 2560, base + 2688, base + 3712, base + 4224
        out = carray(to_ptr(y), (t, o), dtype=np.float32)
        accs = carray(to_ptr(acc), (per, TILE), dtype=np.float32)
        tiles = t >= TILE  # fewer inputs than a tile: lane passes, the same sums
        for t0 in range(0, t, per):
            t1 = min(t, t0 + per)
            m = min(TILE, t1 - t0)
            if tiles:
                tile_config(m, 16 if mode == G16 else 32)
            accs[:t1 - t0] = 0.0
            for blk in range(blocks):
                if blk % SCALE_BLOCKS == 0:
                    scales(kind, scale, offset, groups * size, rows, blk, min(SCALE_BLOCKS, blocks - blk), group,
                           sbuf, mbuf)
                prepare(kind, data, p, rows, blk, bbuf, wbuf)
                slot = blk % SCALE_BLOCKS
                tok = t0
                while tok < t1:
                    first = min(tok, t1 - m)  # a last partial tile overlaps the previous one: one tile shape
                    step(kind, tiles, xq + first * n + 32 * blk, n, bbuf, cbuf, wbuf, sbuf + 128 * slot,
                         mbuf + 64 * slot, xd + 4 * (first * blocks + blk), xs + 4 * (first * blocks + blk),
                         4 * blocks, acc + 64 * (first - t0), tok - first, m)
                    tok = first + m
            for k in range(t1 - t0):
                if rows == TILE:
                    copy_row(y + 4 * ((t0 + k) * o + r0), acc + 64 * k)
                else:
                    for j in range(rows):
                        out[t0 + k, r0 + j] = accs[k, j]
        if tiles:
            tile_release()
    return chunk

