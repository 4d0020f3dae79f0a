"""The CPU quantized matmul on int8 activations: integer dot products of the weights' 4- or 8-bit values with the
activations' int8 blocks (`activations`), one path per instruction set (`isa`), numba loops around LLVM IR.

The arithmetic, for output (row r, input t), is the same on every path, for every row count and thread split:
- per pair of 32-value blocks (64 values), 16 exact int32 lanes, lane j the sum of the products of values
  4j..4j+3 (`_lanes`: vpdpbusd, or vpmaddubsw + vpmaddwd);
- those lanes, converted to float, times the pair's scales ``w_scale * x_d`` (a lane's own group: [s0 x8, s1 x8]
  for groups of 32, [s0 x4 .. s3 x4] for 16, one scale for coarser groups; the products made once per 4 pairs)
  added into one 16-float accumulator with llvm.fma, pair after pair;
- for formats with an offset (affine groups; symmetric 4-bit's -8 * scale), each block's ``offset * x_s`` added
  into the accumulator's first lanes once per 4 pairs (per pair for a row's last pairs);
- the accumulator summed by a fixed tree.
Unsigned weights (4-bit, 0..15) meet the activations as they are; signed 8-bit weights as ``w + 128`` with the lanes
started at ``-128 * (x's lane sums)`` on VNNI, as |w| against x with w's sign on AVX2 (so every int16 pair stays
under 2 * 128 * 127): the same lanes. A decode step (one input) and bigger steps run the same code on blocks of
weight rows and inputs (`BLOCKS`): a row's values are unpacked once per pair and meet every input of the block.
Memory traffic is the packed weights and the int8 inputs; the kernel quantizes the inputs itself (`_quantize_row`)
first. The ``amx`` path's chunk loops are `cpu_amx_kernel`'s, with their own arithmetic; the launch, operands and
input quantization here serve it too."""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
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
    stable_key,
    symbol,
    to_int,
    to_ptr,
)
from pallas_kernels.quantized_matmul import isa as isa_mod  # noqa: E402
from pallas_kernels.quantized_matmul.activations import INV_127  # noqa: E402

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)

_F32, _HALF = ir.FloatType(), ir.HalfType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, 16)
_VL = ir.VectorType(_I32, 16)  # the 16 int32 lanes of a pair
_VB = ir.VectorType(_I8, 64)  # a pair's 64 byte values


def _c(v):
    return ir.Constant(_I64, v)


def _mask(indices):
    return ir.Constant(ir.VectorType(_I32, len(indices)), list(indices))


def _ptr(b, addr, ty, offset=None):
    if offset is not None:
        addr = b.add(addr, offset if not isinstance(offset, int) else _c(offset))
    return b.inttoptr(addr, ty.as_pointer())


def _load(b, addr, ty, offset=None, align=1):
    return b.load(_ptr(b, addr, ty, offset), align=align)


def _fn(b, name, ret, args):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _split(b, v, parts):
    """v's elements in `parts` equal consecutive pieces."""
    n = v.type.count // parts
    return [b.shuffle_vector(v, v, _mask(range(i * n, (i + 1) * n))) for i in range(parts)]


def _splat(b, x, ty):
    """The scalar x in every lane of a `ty` vector."""
    return b.shuffle_vector(b.insert_element(ir.Constant(ty, None), x, ir.Constant(_I32, 0)), ir.Constant(ty, None),
                            _mask([0] * ty.count))


def _join(b, pieces):
    while len(pieces) > 1:
        n = pieces[0].type.count
        pieces = [b.shuffle_vector(pieces[i], pieces[i + 1], _mask(range(2 * n))) for i in range(0, len(pieces), 2)]
    return pieces[0]


def _lanes(b, isa, u, s, start=None):
    """start + u (<64 x i8>, unsigned) . s (<64 x i8>, signed) -> <16 x i32>, lane j = start's lane j plus the sum of
    products 4j..4j+3 (start: <16 x i32> or None for zeros; the VNNI paths only)."""
    start = ir.Constant(_VL, [0] * 16) if start is None else start
    if isa == "vnni512":
        fn = _fn(b, "llvm.x86.avx512.vpdpbusd.512", _VL, [_VL, _VL, _VL])
        return b.call(fn, [start, b.bitcast(u, _VL), b.bitcast(s, _VL)])
    v8 = ir.VectorType(_I32, 8)
    out = []
    for uh, sh, st in zip(_split(b, u, 2), _split(b, s, 2), _split(b, start, 2), strict=True):  # <32 x i8> halves
        if isa == "vnni256":
            fn = _fn(b, "llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8])
            out.append(b.call(fn, [st, b.bitcast(uh, v8), b.bitcast(sh, v8)]))
        else:
            v16 = ir.VectorType(_I16, 16)
            pairs = b.call(_fn(b, "llvm.x86.avx2.pmadd.ub.sw", v16, [uh.type, sh.type]), [uh, sh])
            out.append(b.call(_fn(b, "llvm.x86.avx2.pmadd.wd", v8, [v16, v16]), [pairs, ir.Constant(v16, [1] * 16)]))
    return _join(b, out)


def _floats(b, addr, count, half, offset=None):
    """`count` consecutive scales at addr (float16 bits or float32) as a <count x float>."""
    if half:
        raw = _load(b, addr, ir.VectorType(_HALF, count), offset, align=2)
        return b.fpext(raw, ir.VectorType(_F32, count))
    return _load(b, addr, ir.VectorType(_F32, count), offset, align=4)


def _repeat(b, v, times):
    """<k x float> -> <k * times x float>, each value repeated `times` times in place."""
    k = v.type.count
    return b.shuffle_vector(v, v, _mask([i // times for i in range(k * times)]))


# Scale layouts: per 16 values (GGUF Q6_K), per 32 (most), per 64 or more / per row (one scale a pair: its index
# is the pair's first value >> log2(group), 63 for per-row).
G16, G32, COARSE = 0, 1, 2


def _emit_dots(b, isa, bits, half, scale_mode, off_mode, rows, toks, args):
    """y at y + j * y_stride + 4 * k (float32) = row k . input j (k < rows, j < toks): the pairs' lanes times
    their scales, and the blocks' offset terms, accumulated pair after pair and summed."""
    (data, data_stride, scale, offset, scale_stride, xq, xq_stride, xd, xs, xd_stride, n, group, y,
     y_stride) = args
    size = 2 if half else 4
    zero = ir.Constant(_V, [0.0] * 16)

    def x_of(p, j):
        """Input j's 64 values of pair p, and the lanes its 8-bit products start from (VNNI)."""
        x = _load(b, b.add(xq, b.mul(_c(j), xq_stride)), _VB, b.mul(p, _c(64)))
        if bits == 8 and isa != "avx2":
            sums = _lanes(b, isa, ir.Constant(_VB, [1] * 64), x, None)
            return x, b.mul(sums, ir.Constant(_VL, [-128] * 16))
        return x, None

    def weights_of(k, p):
        """Row k's 64 values of pair p as unsigned bytes, and (avx2's 8-bit) the signed values whose signs the
        inputs take."""
        row = b.add(data, b.mul(_c(k), data_stride))
        if bits == 4:
            raw = _load(b, row, ir.VectorType(_I8, 32), b.mul(p, _c(32)))
            lo = b.and_(raw, ir.Constant(raw.type, [15] * 32))
            hi = b.lshr(raw, ir.Constant(raw.type, [4] * 32))
            return b.shuffle_vector(lo, hi, _mask([*range(16), *range(32, 48), *range(16, 32),
                                                   *range(48, 64)])), None
        w = _load(b, row, _VB, b.mul(p, _c(64)))
        if isa == "avx2":  # |w| against x with w's sign: int16 pairs stay under 2 * 128 * 127
            return b.call(_fn(b, "llvm.abs.v64i8", _VB, [_VB, ir.IntType(1)]), [w, ir.Constant(ir.IntType(1), 0)]), w
        # w + 128 (unsigned) against x, lanes started at -128 * (x's lane sums): the same lanes
        return b.xor(w, ir.Constant(_VB, [-128] * 64)), None

    def accumulate(k, p, j, u, negative, s, acc):
        """acc + the lanes of row k . input j over pair p, times s (the lanes' w_scale * x_d)."""
        x, start = x_of(p, j)
        if negative is not None:  # x's sign turned by w's (vpsignb: 0 where w is, but |w| is 0 there too)
            v32 = ir.VectorType(_I8, 32)
            x = _join(b, [b.call(_fn(b, "llvm.x86.avx2.psign.b", v32, [v32, v32]), [xh, wh])
                          for xh, wh in zip(_split(b, x, 2), _split(b, negative, 2), strict=True)])
        return ir_fma16(b, b.sitofp(_lanes(b, isa, u, x, start), _V), s, acc)

    def row_scales(k, base, first, pairs):
        """Row k's scales (or offsets: base) for `pairs` pairs from pair `first`: 4 a pair (G16), 2 (G32)
        or 1 (coarser)."""
        srow = b.add(base, b.mul(_c(k), scale_stride))
        if scale_mode == G16:
            return _floats(b, srow, 4 * pairs, half, b.mul(first, _c(4 * size)))
        if scale_mode == G32:
            return _floats(b, srow, 2 * pairs, half, b.mul(first, _c(2 * size)))
        vec = ir.Constant(ir.VectorType(_F32, pairs), None)
        for i in range(pairs):
            index = b.lshr(b.mul(b.add(first, _c(i)), _c(64)), group)
            v = b.extract_element(_floats(b, srow, 1, half, b.mul(index, _c(size))), ir.Constant(_I32, 0))
            vec = b.insert_element(vec, v, ir.Constant(_I32, i))
        return vec

    def products(sw, dx):
        """w_scale * x_d for the blocks of some pairs: sw as row_scales gives it, dx one per block (2 a
        pair) -> a vector holding, for every lane of those pairs, its product (see `lane_scales`)."""
        if scale_mode == G16:  # 4 scales a pair: scale m of the group belongs to block m // 2
            return b.fmul(sw, _repeat(b, dx, 2))
        if scale_mode == G32:
            return b.fmul(sw, dx)
        return b.fmul(_repeat(b, sw, 2), dx)  # one scale a pair, for both its blocks

    def lane_scales(prod, i):
        """Pair i's 16 lanes' products, out of `products` of its group (lanes 0-7: its first block)."""
        if scale_mode == G16:
            return b.shuffle_vector(prod, prod, _mask([4 * i + lane // 4 for lane in range(16)]))
        return b.shuffle_vector(prod, prod, _mask([2 * i + lane // 8 for lane in range(16)]))

    def grouped(pairs):
        """A loop body over groups of `pairs` pairs: each (row, input)'s scale products made once per
        group, the same floats as a pair at a time would make (fmul of the same operands)."""
        def body(g, accs):
            p0 = b.mul(g, _c(pairs)) if pairs > 1 else g
            dxs = [_floats(b, b.add(xd, b.mul(_c(j), xd_stride)), 2 * pairs, False, b.mul(p0, _c(8)))
                   for j in range(toks)]
            out = list(accs)
            if off_mode != NO_OFFSET:
                xss = [_floats(b, b.add(xs, b.mul(_c(j), xd_stride)), 2 * pairs, False, b.mul(p0, _c(8)))
                       for j in range(toks)]
            for k in range(rows):
                sw = row_scales(k, scale, p0, pairs)
                prods = [products(sw, dxs[j]) for j in range(toks)]
                if off_mode != NO_OFFSET:  # one offset a block: its term lands in the block's first lanes
                    if off_mode == NEG8:
                        om = b.fmul(sw, ir.Constant(sw.type, [-8.0] * sw.type.count))
                    else:
                        om = row_scales(k, offset, p0, pairs)
                    if scale_mode == COARSE:
                        om = _repeat(b, om, 2)
                    for j in range(toks):
                        terms = b.fmul(om, xss[j])  # <2 * pairs x float>, block order
                        wide = b.shuffle_vector(terms, ir.Constant(terms.type, [0.0] * (2 * pairs)),
                                                _mask([*range(2 * pairs), *[2 * pairs] * (16 - 2 * pairs)]))
                        out[j * rows + k] = b.fadd(out[j * rows + k], wide)
                for i in range(pairs):
                    p = b.add(p0, _c(i))
                    u, negative = weights_of(k, p)
                    for j in range(toks):
                        n_ = j * rows + k
                        out[n_] = accumulate(k, p, j, u, negative, lane_scales(prods[j], i), out[n_])
            return out
        return body

    pairs = b.udiv(n, _c(64))
    quads = b.udiv(pairs, _c(4))
    accs = ir_for(b, quads, [zero] * (rows * toks), grouped(4))
    done = b.mul(quads, _c(4))
    accs = ir_for(b, b.sub(pairs, done), accs, lambda i, a: grouped(1)(b.add(done, i), a))
    for j in range(toks):
        yj = b.add(y, b.mul(_c(j), y_stride))
        for k in range(rows):
            b.store(ir_hsum(b, accs[j * rows + k]), _ptr(b, yj, _F32, 4 * k), align=4)


def _dots(isa, bits, half, variants):
    """An intrinsic ``dots(variant, data, data_stride, scale, offset, scale_stride, xq, xq_stride, xd, xs,
    xd_stride, n, group, y, y_stride)`` running `_emit_dots` for ``variants[variant]`` ((scale mode, offset mode,
    rows, inputs) tuples): one switch in the IR, so the numba loop around it stays one call."""
    @intrinsic
    def dots(typingctx, variant, data, data_stride, scale, offset, scale_stride, xq, xq_stride, xd, xs, xd_stride,
             n, group, y, y_stride):
        def codegen(context, b, sig, args):
            done = b.append_basic_block("dots_done")
            switch = b.switch(args[0], done)
            for index, (scale_mode, off_mode, rows, toks) in enumerate(variants):
                block = b.append_basic_block(f"dots_{index}")
                switch.add_case(index, block)
                b.position_at_end(block)
                _emit_dots(b, isa, bits, half, scale_mode, off_mode, rows, toks, args[1:])
                b.branch(done)
            b.position_at_end(done)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 15), codegen
    return stable_key(dots, __name__, "dots", isa, bits, half, tuple(variants))


# Offset terms, folded into the accumulators: none (8-bit symmetric), -8 * scale (4-bit symmetric), the weight's
# offsets (affine, grouped as its scales).
NO_OFFSET, NEG8, AFFINE = 0, 1, 2


# The (scale mode, offset mode) pairs of a data width, in the order of the index `chunk_setup` picks (both the lane
# and the AMX chunk loops switch on it).
KINDS = {4: ((G32, NEG8), (G32, AFFINE)),
         8: ((G16, NO_OFFSET), (G32, NO_OFFSET), (G32, AFFINE), (COARSE, NO_OFFSET), (COARSE, AFFINE))}


@intrinsic
def _quantize_row(typingctx, x, n, q, d, s, sums):
    """One input row of n float32 at x -> its int8 blocks: q (n int8), d and s (n / 32 float32), exactly as
    `activations.quantize` computes them: d = max|x| * float32(1 / 127), q = round-half-even(x * (1 / d)) clamped to
    [-127, 127] (0 where d is 0), s = d * sum(q); and sums (n / 32 int32) = sum(q), exact (what the loops on
    8-bit weights stored plus 128 take back, once a call instead of once a row group)."""
    def codegen(context, b, sig, args):
        x, n, q, d, s, sums = args
        v16i8, v16i32 = ir.VectorType(_I8, 16), ir.VectorType(_I32, 16)

        def body(i, carried):
            halves = [_load(b, x, _V, b.add(b.mul(i, _c(128)), _c(64 * h)), align=4) for h in (0, 1)]
            fabs = _fn(b, "llvm.fabs.v16f32", _V, [_V])
            a, c = (b.call(fabs, [h]) for h in halves)
            m = b.select(b.fcmp_ordered(">", c, a), c, a)
            width = 16
            while width > 1:  # max is exact: any order gives the same value
                width //= 2
                lo, hi = (b.shuffle_vector(m, m, _mask(range(k, k + width))) for k in (0, width))
                m = b.select(b.fcmp_ordered(">", hi, lo), hi, lo)
            amax = b.extract_element(m, ir.Constant(_I32, 0))
            dd = b.fmul(amax, ir.Constant(_F32, float(INV_127)))
            positive = b.fcmp_ordered(">", dd, ir.Constant(_F32, 0.0))
            inv = b.select(positive, b.fdiv(ir.Constant(_F32, 1.0), dd), ir.Constant(_F32, 0.0))
            inv_v = b.shuffle_vector(b.insert_element(ir.Constant(_V, None), inv, ir.Constant(_I32, 0)),
                                     ir.Constant(_V, None), _mask([0] * 16))
            total = ir.Constant(v16i32, [0] * 16)
            for h, half in enumerate(halves):
                r = b.call(_fn(b, "llvm.roundeven.v16f32", _V, [_V]), [b.fmul(half, inv_v)])
                r = b.call(_fn(b, "llvm.minnum.v16f32", _V, [_V, _V]), [r, ir.Constant(_V, [127.0] * 16)])
                r = b.call(_fn(b, "llvm.maxnum.v16f32", _V, [_V, _V]), [r, ir.Constant(_V, [-127.0] * 16)])
                qi = b.fptosi(r, v16i32)
                total = b.add(total, qi)
                b.store(b.trunc(qi, v16i8), _ptr(b, q, v16i8, b.add(b.mul(i, _c(32)), _c(16 * h))), align=1)
            width = 16
            while width > 1:  # integer: exact in any order
                width //= 2
                lo, hi = (b.shuffle_vector(total, total, _mask(range(k, k + width))) for k in (0, width))
                total = b.add(lo, hi)
            exact = b.extract_element(total, ir.Constant(_I32, 0))
            qsum = b.sitofp(exact, _F32)
            b.store(exact, _ptr(b, sums, _I32, b.mul(i, _c(4))), align=4)
            b.store(dd, _ptr(b, d, _F32, b.mul(i, _c(4))), align=4)
            b.store(b.fmul(dd, qsum), _ptr(b, s, _F32, b.mul(i, _c(4))), align=4)
            return []
        ir_for(b, b.udiv(n, _c(32)), [], body)
        return context.get_dummy_value()
    return types.void(*[types.int64] * 6), codegen


QUANTIZE_ROWS = 64  # input rows a chunk of the quantizing launch (decode batches: one chunk, no helper)


@numba.cfunc(types.void(types.int64, types.int64), cache=True, error_model="numpy", boundscheck=False)
def _quantize_chunk(words, c):
    x, q, d, s, t, n, sums = load64(words), load64(words + 8), load64(words + 16), load64(words + 24), \
        load64(words + 32), load64(words + 40), load64(words + 48)
    blocks = n // 32
    for row in range(c * QUANTIZE_ROWS, min(t, (c + 1) * QUANTIZE_ROWS)):
        _quantize_row(x + 4 * n * row, n, q + n * row, d + 4 * blocks * row, s + 4 * blocks * row,
                      sums + 4 * blocks * row)


export_symbol("jaxllm_cpu_q8act_quantize_chunk", _quantize_chunk.address)
_quantize_chunk_fn = symbol("jaxllm_cpu_q8act_quantize_chunk", True)


ROWS_PER_CHUNK = 16


@numba.njit(inline="always", **_KW)
def _chunk_args(words, chunk):
    o = load64(words + 72)
    r0 = chunk * ROWS_PER_CHUNK
    return (load64(words), load64(words + 8), load64(words + 16), load64(words + 24), load64(words + 32),
            load64(words + 40), load64(words + 48), load64(words + 56), load64(words + 64), o, load64(words + 80),
            load64(words + 88), load64(words + 96), r0, min(o, r0 + ROWS_PER_CHUNK))


@numba.njit(inline="always", **_KW)
def chunk_setup(words, c, bits, size, grouped):
    """A chunk's operands (`_chunk_args`; a grouped matmul's from its launch table entry c: weight matrix, first
    input, inputs, first output row), the log2 of its scale group (63: one a row), its scale mode and the kind
    index its loops switch on (`_chunk`'s kinds)."""
    xq, xd, xs, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1 = _chunk_args(words, c)
    blocks = n // 32
    if grouped:
        entry = load64(words + 104) + 32 * c
        matrix, first, t, r0 = load64(entry), load64(entry + 8), load64(entry + 16), load64(entry + 24)
        r1 = min(o, r0 + ROWS_PER_CHUNK)
        xq, xd, xs, y = xq + first * n, xd + first * blocks * 4, xs + first * blocks * 4, y + first * o * 4
        data, scale = data + matrix * o * p, scale + matrix * o * groups * size
        offset += matrix * o * offset_groups * size
    group = 63
    if groups > 1:
        group = 0
        while (1 << group) < n // groups:
            group += 1
    mode = G16 if group == 4 else (G32 if group == 5 else COARSE)
    if bits == 4:
        kind = 1 if offset_groups > 0 else 0
    elif mode == G16:
        kind = 0
    elif mode == G32:
        kind = 2 if offset_groups > 0 else 1
    else:
        kind = 4 if offset_groups > 0 else 3
    return (xq, xd, xs, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1, group, mode, kind)


# (weight rows, inputs) a pass of a step with several inputs: every pair of them gets a 16-lane accumulator, two
# registers on 256-bit paths, which have 16: with 4 rows x 2 inputs a quarter of the AVX2 loop's instructions
# were spills and reloads (1 x 4: a row's unpacked values meet 4 inputs; vnni256 by the same count, unmeasured).
# On AVX-512 (32 registers), 4 x 4 spilled a quarter of them. A decode step (one input) runs 4 rows a pass on
# every path: four weight streams in flight. The blocking never changes a result: each lane's accumulation is the
# same whatever the pass holds.
BLOCKS = {"vnni512": (4, 2), "vnni256": (1, 4), "avx2": (1, 4)}
PREFETCH_ROWS = 16
X_BLOCK_BYTES = 1 << 17


def _chunk(isa, bits, half, grouped=False):
    """The loop over a chunk's output rows for one instruction set and data layout: ``chunk(words, c)``, a numba
    cfunc's body. Its closure holds only intrinsics and constants, which numba's disk cache keys by their
    definitions and values (a dispatcher in a closure would be keyed by a per-process id: a miss, and a new cache
    entry, every process). grouped: a chunk of a grouped matmul (`grouped_handler`): its weight matrix, inputs and
    output rows are the launch table's entry c."""
    rows_many, toks = BLOCKS[isa]
    kinds = KINDS[bits]
    # the passes a chunk runs, each compiled once (on 256-bit paths the block is itself a row's pass of toks)
    shapes = tuple(dict.fromkeys(((4, 1), (rows_many, toks), (1, toks), (1, 1))))
    per_kind = len(shapes)
    four, blocked, row_of_many, single = (shapes.index(s) for s in ((4, 1), (rows_many, toks), (1, toks), (1, 1)))
    variants = [(m, off, r, t) for m, off in kinds for r, t in shapes]
    dots = _dots(isa, bits, half, variants)

    def chunk(words, c):
        """y[:, r0:r1] = the int8 product of the inputs' blocks and rows r0:r1 of W, for the chunk's rows
        (addresses; xq [t, n] int8, xd and xs [t, n / 32] float32, data [o, p] bytes, scale / offset [o, groups]
        / [o, offset_groups], y [t, o] float32)."""
        (xq, xd, xs, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1, group, mode,
         kind) = chunk_setup(words, c, bits, 2 if half else 4, grouped)
        size = 2 if half else 4
        blocks = n // 32
        block = max(1, X_BLOCK_BYTES // n)
        for t0 in range(0, t, block):  # inputs in blocks that stay in L2 while every weight row meets them
            t1 = min(t, t0 + block)
            r = r0
            while r < r1:
                rows = 4 if t < toks else rows_many  # inputs too few for a block: a row block meets each
                rows = rows if r + rows <= r1 else 1
                if t == 1:
                    ahead = r + PREFETCH_ROWS  # the hardware prefetcher alone leaves decode latency-bound
                    if ahead + 4 <= o:
                        for line in range(data + ahead * p, data + (ahead + 4) * p, 64):
                            prefetch_l2(line)
                        for line in range(scale + ahead * groups * size, scale + (ahead + 4) * groups * size, 64):
                            prefetch_l2(line)
                        for line in range(offset + ahead * offset_groups * size,
                                          offset + (ahead + 4) * offset_groups * size, 64):
                            prefetch_l2(line)
                tok = t0
                while tok < t1:
                    many = tok + toks <= t1
                    if many:
                        variant = per_kind * kind + (blocked if rows == rows_many else row_of_many)
                    else:
                        variant = per_kind * kind + (four if rows == 4 else single)
                    dots(variant, data + r * p, p, scale + r * groups * size, offset + r * groups * size,
                         groups * size, xq + tok * n, n, xd + tok * blocks * 4, xs + tok * blocks * 4, blocks * 4, n,
                         group, y + 4 * (tok * o + r), 4 * o)
                    tok += toks if many else 1
                r += rows
    return chunk


LAYOUTS = ("q4_f16", "q4_f32", "q8_f16", "q8_f32")


@functools.cache
def handler(isa: str, interleaved: bool = False):
    """The XLA:CPU FFI handler (a numba cfunc, ``pallas_kernels.cpu_ffi.HANDLER``) of `isa`'s path, compiled (or
    loaded from numba's disk cache) on first use: a path is only ever built on a CPU that runs it. interleaved:
    the loops for weights interleaved by 16 rows (`cpu_x16_kernel`; `isa` one of `cpu.X16_ISAS`)."""
    from pallas_kernels.quantized_matmul.cpu import X16_ISAS
    if not isa_mod.supported(isa) or (interleaved and isa not in X16_ISAS):
        raise ValueError(f"no {'interleaved ' if interleaved else ''}{isa} path here ({isa_mod.describe()})")
    return _build(isa, interleaved)


def _chunk_symbols(isa: str, grouped: bool = False, interleaved: bool = False) -> tuple:
    """Compiles (or loads) `isa`'s four chunk loops (4-/8-bit data, float16/float32 scales; a grouped matmul's
    with `grouped`, the interleaved weights' with `interleaved`) and returns the intrinsics of their addresses, in
    LAYOUTS order."""
    kind = "grouped_chunk" if grouped else "x16_chunk" if interleaved else "chunk"
    if interleaved:
        from pallas_kernels.quantized_matmul.cpu_x16_kernel import chunk_fn
    elif isa == "amx":
        isa_mod.request_amx()
        from pallas_kernels.quantized_matmul.cpu_amx_kernel import chunk_fn
    else:
        chunk_fn = functools.partial(_chunk, isa)
    for layout in LAYOUTS:
        cfunc = numba.cfunc(types.void(types.int64, types.int64), **_CACHE)(
            chunk_fn(4 if layout[1] == "4" else 8, layout.endswith("f16"), grouped=grouped))
        export_symbol(f"jaxllm_cpu_q8act_{kind}_{isa}_{layout}", cfunc.address)
        _KEEP.append(cfunc)
    return tuple(symbol(f"jaxllm_cpu_q8act_{kind}_{isa}_{layout}", True) for layout in LAYOUTS)


@numba.njit(inline="always", **_KW)
def _operands(frame):
    """The matmul operands both handlers read: (x, data, scale, offset and output addresses; t, n, o, p, groups,
    offset groups, the scales' size; whether the data is 4-bit; the dims of data)."""
    x_p, x_d = buffer(frame, 0)
    d_p, d_d = buffer(frame, 1)
    s_p, s_d = buffer(frame, 2)
    o_p, o_d = buffer(frame, 3)
    y_p, _ = buffer(frame, 0, True)
    xq_p, _ = buffer(frame, 1, True)
    xd_p, _ = buffer(frame, 2, True)
    xs_p, _ = buffer(frame, 3, True)
    scale_size = 2 if buffer_dtype(frame, 2) == F16 else 4
    return (x_p, d_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, dim(x_d, 0), dim(x_d, 1), dim(d_d, 1), dim(d_d, 2),
            dim(s_d, 2), dim(o_d, 2), scale_size, buffer_dtype(frame, 1) == U8, dim(d_d, 0))


@numba.njit(inline="always", **_KW)
def layer_operands(frame):
    """`_operands` with the weight's addresses at the layer its input 4 names (clamped into range, as XLA clamps a
    dynamic slice's), less the matrix count."""
    (x_p, d_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, t, n, o, p, groups, offset_groups, scale_size, four_bit,
     matrices) = _operands(frame)
    layer_p, _ = buffer(frame, 4)
    layer = min(max(np.int64(load32(layer_p)), 0), matrices - 1)
    d_p += layer * o * p
    s_p += layer * o * groups * scale_size
    o_p += layer * o * offset_groups * scale_size
    return x_p, d_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, t, n, o, p, groups, offset_groups, scale_size, four_bit


@numba.njit(inline="always", **_KW)
def _pick(four_bit, scale_size, q4_f16, q4_f32, q8_f16, q8_f32):
    """The chunk loop's address for the data's layout."""
    if four_bit:
        return q4_f16 if scale_size == 2 else q4_f32
    return q8_f16 if scale_size == 2 else q8_f32


def _build(isa: str, interleaved: bool):
    """The handler of one path, dispatching to four chunk loops (4-/8-bit data, float16/float32 scales), 16 output
    rows a chunk (`cpu_x16_kernel`'s: one 16-row group)."""
    q4_f16, q4_f32, q8_f16, q8_f32 = _chunk_symbols(isa, interleaved=interleaved)

    def ffi_handler(frame_ptr):
        """Inputs: x [T, in] f32, data [L, out, P] u8/s8, scale [L, out, G] f16/f32, offset [L, out, G' or 0],
        layer [] s32; outputs y [T, out] f32 and the scratch the inputs' int8 blocks are written to: xq [T, in]
        s8, xd and xs [T, in / 32] f32. The layer index is clamped into range, as XLA clamps a dynamic slice's."""
        frame = to_int(frame_ptr)
        if is_execute(frame):
            (x_p, d_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, t, n, o, p, groups, offset_groups, scale_size,
             four_bit) = layer_operands(frame)
            sums = np.empty((t, n // 32), np.int32)
            sums_p = np.int64(sums.ctypes.data)
            launch(frame, (x_p, xq_p, xd_p, xs_p, t, n, sums_p), (t + QUANTIZE_ROWS - 1) // QUANTIZE_ROWS,
                   _quantize_chunk_fn(), True)
            fn = _pick(four_bit, scale_size, q4_f16(), q4_f32(), q8_f16(), q8_f32())
            # word 13 is a grouped launch's table (none here), word 14 the block sums (`cpu_x16_kernel` reads them)
            launch(frame, (xq_p, xd_p, xs_p, d_p, s_p, o_p, y_p, t, n, o, p, groups, offset_groups, 0, sums_p),
                   (o + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK, fn, True)
            keep_alive(sums)
        return to_ptr(0)
    return numba.cfunc(HANDLER, **_CACHE)(ffi_handler)


@numba.njit(**_KW)
def group_rows(experts, num_experts, base, o):
    """Rows by expert: (order [R]: the rows grouped by expert, in row order within an expert (a stable counting
    sort); the launch's chunks [n, 4]: per expert with rows, one entry per ROWS_PER_CHUNK output rows, (weight
    matrix base + expert, its first row in `order`, its rows, first output row)). An expert index out of range is
    clamped into it."""
    counts = np.zeros(num_experts + 1, np.int64)
    for r in range(experts.shape[0]):
        counts[min(max(np.int64(experts[r]), 0), num_experts - 1) + 1] += 1
    for e in range(num_experts):
        counts[e + 1] += counts[e]  # counts[e]: expert e's first slot
    order = np.empty(experts.shape[0], np.int64)
    fill = counts[:num_experts].copy()
    for r in range(experts.shape[0]):
        e = min(max(np.int64(experts[r]), 0), num_experts - 1)
        order[fill[e]] = r
        fill[e] += 1
    per = (o + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK
    used = 0
    for e in range(num_experts):
        used += counts[e + 1] > counts[e]
    table = np.empty((used * per, 4), np.int64)
    i = 0
    for e in range(num_experts):
        if counts[e + 1] == counts[e]:
            continue
        for j in range(per):
            table[i, 0], table[i, 1], table[i, 2] = base + e, counts[e], counts[e + 1] - counts[e]
            table[i, 3] = j * ROWS_PER_CHUNK
            i += 1
    return order, table


@numba.njit(**_KW)
def _gather_rows(x_p, order, t, n):
    x = carray(to_ptr(x_p), (t, n), dtype=np.float32)
    out = np.empty((t, n), np.float32)
    for i in range(t):
        for j in range(n):  # element loops: numba compiles a row slice's broadcasting for seconds
            out[i, j] = x[order[i], j]
    return out


@numba.njit(**_KW)
def _scatter_rows(y_p, order, rows):
    t, o = rows.shape
    y = carray(to_ptr(y_p), (t, o), dtype=np.float32)
    for i in range(t):
        for j in range(o):
            y[order[i], j] = rows[i, j]


@functools.cache
def grouped_handler(isa: str):
    """The FFI handler of `isa`'s grouped matmul (a mixture of experts' projections): built on first use, so
    that dense models never compile it."""
    if not isa_mod.supported(isa):
        raise ValueError(f"no {isa} path here ({isa_mod.describe()})")
    q4_f16, q4_f32, q8_f16, q8_f32 = _chunk_symbols(isa, grouped=True)

    def ffi_handler(frame_ptr):
        """Inputs: x [R, in] f32, data [M, out, P] u8/s8, scale [M, out, G] f16/f32, offset [M, out, G' or 0],
        experts [R] s32 (each row's, any order), base [2] s32 (the first matrix of this call's experts, their
        count: row r's matrix is base[0] + experts[r], clamped into range); outputs y [R, out] f32 and the int8
        blocks' scratch, as `handler`'s (the rows grouped by expert there). The rows are grouped by expert here
        (each expert's matrix then meets all of its rows in one pass), multiplied, and put back in order."""
        frame = to_int(frame_ptr)
        if is_execute(frame):
            (x_p, d_p, s_p, o_p, y_p, xq_p, xd_p, xs_p, t, n, o, p, groups, offset_groups, scale_size, four_bit,
             matrices) = _operands(frame)
            experts_p, _ = buffer(frame, 4)
            base_p, _ = buffer(frame, 5)
            count = min(max(np.int64(load32(base_p + 4)), 1), matrices)
            base = min(max(np.int64(load32(base_p)), 0), matrices - count)
            order, table = group_rows(carray(to_ptr(experts_p), (t,), dtype=np.int32), count, base, o)
            rows = _gather_rows(x_p, order, t, n)
            out = np.empty((t, o), np.float32)
            sums = np.empty((t, n // 32), np.int32)
            sums_p = np.int64(sums.ctypes.data)
            launch(frame, (np.int64(rows.ctypes.data), xq_p, xd_p, xs_p, t, n, sums_p),
                   (t + QUANTIZE_ROWS - 1) // QUANTIZE_ROWS, _quantize_chunk_fn(), True)
            fn = _pick(four_bit, scale_size, q4_f16(), q4_f32(), q8_f16(), q8_f32())
            launch(frame, (xq_p, xd_p, xs_p, d_p, s_p, o_p, np.int64(out.ctypes.data), t, n, o, p, groups,
                           offset_groups, np.int64(table.ctypes.data), sums_p), table.shape[0], fn, True)
            keep_alive(sums)
            _scatter_rows(y_p, order, out)
            keep_alive(table)
            keep_alive(rows)
        return to_ptr(0)
    return numba.cfunc(HANDLER, **_CACHE)(ffi_handler)


_CACHE = dict(cache=True, error_model="numpy", boundscheck=False)
_KEEP: list = []  # compiled cfuncs stay alive while XLA may call them
