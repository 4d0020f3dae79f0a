"""The CPU attention kernel's inner step: one page of keys folded into the online softmax of a group of query rows
at once, in LLVM IR on vectors whose lanes are query rows: 8 a vector, or 16 (`page_scores_wide`,
`fold_scores_wide`) where the host has 512-bit vectors (`cpu_kernel.attend_block` calls it per group of rows).

Lanes as rows make most of the fold a vector operation: the running max, the exponentials and the row sums are
lane-wise, and the weighted sum of V rows is FMAs of a group's rows against broadcast values (16 rows: half the
instructions of 8 for a prefill chunk's or a speculative step's rows). A decode's few rows (at most 8,
d a multiple of 8) score the keys and weight the values with lanes along d instead (`page_scores_by_row`,
`fold_scores_by_row`), reading the cache page as it is. Each row runs the same arithmetic whatever the other lanes
hold, however many rows the block has and in either layout, so a position's output is the same bits in a decode
step, a prefill chunk or a speculative step, alone or batched. The arithmetic, per row:
- score of key c: 8 chains, chain j = ``fma(q[x], k[c, x], s)`` over x = j, j + 8, ... from 0 (queries
  pre-scaled), summed as ((c0 + c4) + (c2 + c6)) + ((c1 + c5) + (c3 + c7)) (`_tree`, `_hsum`);
- keys outside the row's causal window (``pos > qpos`` or ``pos <= lo``) become `NEG`;
- ``m' = max(m, max_c s_c)``, ``alpha = exp(m - m')``, ``p_c = exp(s_c - m')`` (0 for masked keys),
  ``l' = l * alpha + p_0 + ... + p_{P-1}`` in key order;
- ``acc'[x] = acc[x] * alpha`` then ``fma(p_c, v[c, x], acc')`` in key order.
A row with no visible key in the page keeps m, l and acc (alpha is exp(0) = 1, every p is 0). ``exp`` is `ir_exp`,
the same Cephes polynomial as `cpu_kernel._exp`, with its roundings written out.

Layouts (float32, lane-minor; L = 8 or 16 rows): queries [stride, L], scores [P, L], running max and sum [L] each,
accumulator [stride, L]; keys and values as float32 [P, stride] (the kernel widens a page into buffers first; stride: d
rounded up to a multiple of 8, the columns past d zero); positions [L] int32. By row: queries and accumulator
[rows, d] row-major, keys and values the cache page's own. P (the keys folded: a page's, or those of a sequence's
last page that exist) and d are any counts.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pallas_kernels.cpu_ffi import ir_for
from pallas_kernels.ragged_paged_attention import cpu

LANES = 8  # a vector of the by-row layout (x = j, j + 8, ...: one lane a chain), and of the rows layout's default
CHAINS = 8  # a score's FMA chains (x = j, j + 8, ...), in either layout
WIDE_LANES = 16  # the rows layout on AVX-512 hosts: one 512-bit vector of 16 query rows an FMA
LOG2E, LN2_HI, LN2_LO = np.float32(1.44269504), np.float32(0.693359375), np.float32(-2.12194440e-4)
# exp on [-ln2 / 2, ln2 / 2]: Cephes' expf polynomial (relative error ~1e-7)
EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                          1.6666665459e-1, 5.0000001201e-1))
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_NEG = float(np.float32(cpu.NEG))


def _ptr(b, addr, ty, offset):
    """A pointer to `ty` at addr + offset (a Python int or an i64 value)."""
    if isinstance(offset, int):
        offset = ir.Constant(_I64, offset)
    return b.inttoptr(b.add(addr, offset), ty.as_pointer())


def _load(b, addr, ty, offset=0):
    return b.load(_ptr(b, addr, ty, offset), align=4)


def _store(b, value, addr, offset=0):
    b.store(value, _ptr(b, addr, value.type, offset), align=4)


def _vf(lanes):
    return ir.VectorType(_F32, lanes)


def _vi(lanes):
    return ir.VectorType(_I32, lanes)


_V, _VI = _vf(LANES), _vi(LANES)  # the by-row layout's vectors


def _splat(b, scalar, lanes=LANES):
    vec = b.insert_element(ir.Constant(_vf(lanes), None), scalar, ir.Constant(_I32, 0))
    return b.shuffle_vector(vec, ir.Constant(_vf(lanes), None), ir.Constant(_vi(lanes), [0] * lanes))


def _const(value, lanes=LANES):
    return ir.Constant(_vf(lanes), [float(np.float32(value))] * lanes)


def _call(b, name, *args):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(args[0].type, [a.type for a in args]), name)
    return b.call(fn, list(args))


def _ieee(instr):
    """Marks a float instruction so that numba's fastmath pass, which flags every unflagged float instruction of a
    module ``fast``, leaves it IEEE (``arcp`` only licenses reciprocals, which these instructions do not take): with
    ``fast`` LLVM may reassociate a loop's sums differently for different trip counts, and a row's bits would then
    depend on how many keys its page holds."""
    instr.flags.append("arcp")
    return instr


def _fadd(b, x, y):
    return _ieee(b.fadd(x, y))


def _fsub(b, x, y):
    return _ieee(b.fsub(x, y))


def _fmul(b, x, y):
    return _ieee(b.fmul(x, y))


def _fcmp(b, op, x, y):
    return b.fcmp_ordered(op, x, y, flags=("arcp",))


def _fma(b, x, y, z):
    return _call(b, f"llvm.fma.v{x.type.count}f32", x, y, z)


def _mul(b, *args):
    """i64 product of Python ints and i64 values."""
    out = None
    for a in args:
        a = ir.Constant(_I64, a) if isinstance(a, int) else a
        out = a if out is None else b.mul(out, a)
    return out


def ir_exp(b, x):
    """exp(x) lane-wise for x <= 0 (0 below -87): x = n ln2 + r, exp(x) = 2^n exp(r) with `cpu_kernel`'s Cephes
    polynomial on r."""
    lanes = x.type.count
    n = _call(b, f"llvm.floor.v{lanes}f32", _fma(b, x, _const(LOG2E, lanes), _const(0.5, lanes)))
    r = _fma(b, n, _const(-LN2_HI, lanes), x)
    r = _fma(b, n, _const(-LN2_LO, lanes), r)
    poly = _const(EXP_POLY[0], lanes)
    for c in EXP_POLY[1:]:
        poly = _fma(b, poly, r, _const(c, lanes))
    p = _fadd(b, _fma(b, poly, _fmul(b, r, r), r), _const(1.0, lanes))
    scale = b.bitcast(b.shl(b.add(b.fptosi(n, _vi(lanes)), ir.Constant(_vi(lanes), [127] * lanes)),
                            ir.Constant(_vi(lanes), [23] * lanes)), _vf(lanes))
    return b.select(_fcmp(b, "<", x, _const(-87.0, lanes)), _const(0.0, lanes), _fmul(b, p, scale))


def _tree(b, parts):
    """The sum of 8 partial sums in a fixed tree, ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)): the order
    `_hsum` adds a vector's lanes in, so a score is the same bits whichever layout computed it."""
    w = [_fadd(b, parts[i], parts[i + 4]) for i in range(4)]
    return _fadd(b, _fadd(b, w[0], w[2]), _fadd(b, w[1], w[3]))


def _hsum(b, v):
    """`_tree` over the lanes of one vector (lane j: partial sum j), as a float32."""
    def fold(v, lanes):
        return _fadd(b, v, b.shuffle_vector(v, ir.Constant(_V, None), ir.Constant(_VI, lanes)))
    u = fold(fold(v, [4, 5, 6, 7, 4, 5, 6, 7]), [2, 3, 2, 3, 2, 3, 2, 3])
    return b.extract_element(fold(u, [1] * LANES), ir.Constant(_I32, 0))


def _scores(b, qt, keys, stride, page, scores, lanes):
    """scores[c] = queries . keys[c] for the page's keys, lanes as rows (`lanes` of them): per key 8 independent
    FMA chains, chain j over x = j, j + 8, ... (from 0, in order), summed by `_tree`: the arithmetic of
    `_scores_by_row`."""
    def key(c, _):
        def step(xb, accs):
            out = []
            for j, acc in enumerate(accs):
                x = b.add(_mul(b, xb, CHAINS), ir.Constant(_I64, j))
                k = _splat(b, _load(b, keys, _F32, _mul(b, b.add(_mul(b, c, stride), x), 4)), lanes)
                out.append(_fma(b, _load(b, qt, _vf(lanes), _mul(b, x, 4 * lanes)), k, acc))
            return out
        accs = ir_for(b, b.sdiv(stride, ir.Constant(_I64, CHAINS)), [_const(0.0, lanes)] * CHAINS, step)
        _store(b, _tree(b, accs), scores, _mul(b, c, 4 * lanes))
        return []
    ir_for(b, page, [], key)


def _scores_by_row(b, q, keys, element, d, page, rows, scores):
    """`_scores` with lanes as key positions, for up to 8 rows (a decode's): for each key, each row's 8 chains are
    the lanes of one vector (lane j: x = j, j + 8, ...), summed by `_hsum`, so a score is the same bits as there. q
    is row-major [rows, d] float32, the keys are read from the cache page as they are (d a multiple of 8), and
    scores[c, r] is written for r < rows. A case per row count keeps each row's accumulator in a register while
    a key's 8-value blocks are loaded once for all rows."""
    nx = b.sdiv(d, ir.Constant(_I64, LANES))
    end = b.append_basic_block("rows_done")
    switch = b.switch(rows, end)
    for n in range(1, LANES + 1):
        case = b.append_basic_block(f"rows_{n}")
        switch.add_case(ir.Constant(_I64, n), case)
        b.position_at_end(case)

        def key(c, _, n=n):
            def step(xb, accs):
                at = _mul(b, xb, LANES)
                k = _load_values(b, keys, element, b.add(_mul(b, c, d), at))
                return [_fma(b, _load(b, q, _V, _mul(b, b.add(_mul(b, r, d), at), 4)), k, acc)
                        for r, acc in enumerate(accs)]
            for r, acc in enumerate(ir_for(b, nx, [_const(0.0)] * n, step)):
                _store(b, _hsum(b, acc), scores, _mul(b, b.add(_mul(b, c, LANES), ir.Constant(_I64, r)), 4))
            return []
        ir_for(b, page, [], key)
        b.branch(end)
    b.position_at_end(end)


def _softmax(b, scores, stats, qpos, lo, base, page, lanes=LANES):
    """Masks, folds the page's max and sum into stats ([m, l] x `lanes` rows) and turns the scores into p; the
    factor alpha the accumulator takes."""
    vf, vi = _vf(lanes), _vi(lanes)
    qv, lov = _load(b, qpos, vi), _load(b, lo, vi)
    neg = _const(_NEG, lanes)

    def masked(c, row_max):
        s = _load(b, scores, vf, _mul(b, c, 4 * lanes))
        pos = b.trunc(b.add(base, c), _I32)
        pv = b.shuffle_vector(b.insert_element(ir.Constant(vi, None), pos, ir.Constant(_I32, 0)),
                              ir.Constant(vi, None), ir.Constant(vi, [0] * lanes))
        out = b.or_(b.icmp_signed(">", pv, qv), b.icmp_signed("<=", pv, lov))
        s = b.select(out, neg, s)
        _store(b, s, scores, _mul(b, c, 4 * lanes))
        return [b.select(_fcmp(b, ">", s, row_max[0]), s, row_max[0])]

    (row_max,) = ir_for(b, page, [neg], masked)
    m = _load(b, stats, vf)
    m_new = b.select(_fcmp(b, ">", row_max, m), row_max, m)
    alpha = ir_exp(b, _fsub(b, m, m_new))

    def weights(c, total):
        s = _load(b, scores, vf, _mul(b, c, 4 * lanes))
        p = b.select(_fcmp(b, "==", s, neg), _const(0.0, lanes), ir_exp(b, _fsub(b, s, m_new)))
        _store(b, p, scores, _mul(b, c, 4 * lanes))
        return [_fadd(b, total[0], p)]

    (total,) = ir_for(b, page, [_fmul(b, _load(b, stats, vf, 4 * lanes), alpha)], weights)
    _store(b, m_new, stats)
    _store(b, total, stats, 4 * lanes)
    return alpha


def _weighted_values(b, scores, values, stride, page, alpha, acc, lanes):
    """acc[x] = acc[x] * alpha + sum_c p_c values[c, x], 8 positions x at a time, for x < stride (a multiple of 8:
    the buffer's columns past d are zeros); `lanes` rows."""
    vf = _vf(lanes)

    def block(xb, _):
        at = [_mul(b, b.add(_mul(b, xb, CHAINS), ir.Constant(_I64, j)), 4 * lanes) for j in range(CHAINS)]
        start = [_fmul(b, _load(b, acc, vf, o), alpha) for o in at]

        def step(c, accs):
            p = _load(b, scores, vf, _mul(b, c, 4 * lanes))
            row = b.add(_mul(b, c, stride), _mul(b, xb, CHAINS))
            return [_fma(b, p, _splat(b, _load(b, values, _F32, _mul(b, b.add(row, ir.Constant(_I64, j)), 4)), lanes),
                         a) for j, a in enumerate(accs)]
        for o, a in zip(at, ir_for(b, page, start, step), strict=True):
            _store(b, a, acc, o)
        return []
    ir_for(b, b.sdiv(stride, ir.Constant(_I64, CHAINS)), [], block)


def _load_values(b, values, element, offset):
    """8 consecutive cache values at element ``offset`` as float32 (`cpu_ffi.widen`'s conversions, 8 at a time)."""
    if element == types.float32:
        return _load(b, values, _V, _mul(b, offset, 4))
    bits = _load(b, values, ir.VectorType(ir.IntType(16), LANES), _mul(b, offset, 2))
    if element == types.uint16:  # float16
        return b.fpext(b.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _V)
    wide = b.shl(b.zext(bits, _VI), ir.Constant(_VI, [16] * LANES))  # bfloat16: the upper half of a float32
    return b.bitcast(wide, _V)


def _weighted_values_by_row(b, scores, values, element, d, page, alpha, acc, rows):
    """`_weighted_values` with lanes as value positions: for each of ``rows`` rows, acc[r, x] (row-major [rows, d])
    = acc[r, x] * alpha[r] + sum_c p[c, r] values[c, x], the same arithmetic element by element, in
    rows x d / 8 vector FMAs a key instead of d (a decode's 1-8 rows), reading the cache page as it is."""
    nx = b.sdiv(d, ir.Constant(_I64, LANES))

    def row(r, _):
        a = _splat(b, b.extract_element(alpha, b.trunc(r, _I32)))

        def run(first, width):  # `width` 8-value blocks from block `first`: independent FMA chains over c
            at = [_mul(b, b.add(_mul(b, r, d), _mul(b, b.add(first, ir.Constant(_I64, j)), LANES)), 4)
                  for j in range(width)]

            def step(c, accs):
                p = _splat(b, _load(b, scores, _F32, _mul(b, b.add(_mul(b, c, LANES), r), 4)))
                row_at = b.add(_mul(b, c, d), _mul(b, first, LANES))
                return [_fma(b, p, _load_values(b, values, element, b.add(row_at, ir.Constant(_I64, LANES * j))), x)
                        for j, x in enumerate(accs)]
            for o, x in zip(at, ir_for(b, page, [_fmul(b, _load(b, acc, _V, o), a) for o in at], step), strict=True):
                _store(b, x, acc, o)

        wide = b.sdiv(nx, ir.Constant(_I64, LANES))
        ir_for(b, wide, [], lambda i, _: run(_mul(b, i, LANES), LANES) or [])
        tail = _mul(b, wide, LANES)
        ir_for(b, b.sub(nx, tail), [], lambda i, _: run(b.add(tail, i), 1) or [])
        return []
    ir_for(b, rows, [], row)


def _rows_intrinsics(lanes):
    """(page_scores, fold_scores) on vectors of `lanes` query rows."""
    @intrinsic
    def page_scores(typingctx, qt, keys, stride, page, scores):
        """scores [page, lanes] = `lanes` rows' queries qt [stride, lanes] against a page's keys [page, stride]
        (float32 addresses; columns past d zero). A model that transforms its scores before the softmax
        (soft-capping) does so between this and `fold_scores`."""
        def codegen(context, b, sig, args):
            _scores(b, *args, lanes)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 5), codegen

    @intrinsic
    def fold_scores(typingctx, values, stride, page, scores, stats, acc, qpos, lo, base):
        """Folds a page's first ``page`` keys, their scores in ``scores``, into `lanes` rows' online softmax.
        Addresses: values [page, stride] float32 (columns past d zero), scores [page, lanes] (turned into p), stats
        [2, lanes] (running max, sum), acc [stride, lanes]; qpos/lo [lanes] int32 (a key at position pos is
        visible to a row when lo < pos <= qpos); base: the page's first position."""
        def codegen(context, b, sig, args):
            values, stride, page, scores, stats, acc, qpos, lo, base = args
            alpha = _softmax(b, scores, stats, qpos, lo, base, page, lanes)
            _weighted_values(b, scores, values, stride, page, alpha, acc, lanes)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 9), codegen

    return page_scores, fold_scores


page_scores, fold_scores = _rows_intrinsics(LANES)
page_scores_wide, fold_scores_wide = _rows_intrinsics(WIDE_LANES)


@intrinsic
def page_scores_by_row(typingctx, q, keys, element, d, page, rows, scores):
    """`page_scores` for ``rows`` <= 8 rows (a decode's), the same bits: q [rows, d] float32 row-major, the keys
    read from the cache page at address ``keys`` (``element``: one of its elements, whose numba type names the
    format as in `cpu_ffi.widen`; d a multiple of 8); writes scores[c, r] for r < rows."""
    def codegen(context, b, sig, args):
        q, keys, _, d, page, rows, scores = args
        _scores_by_row(b, q, keys, element, d, page, rows, scores)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, element, *[types.int64] * 4), codegen


@intrinsic
def fold_scores_by_row(typingctx, values, element, d, page, scores, stats, acc, qpos, lo, base, rows):
    """`fold_scores` for ``rows`` <= 8 rows (a decode's) with a row-major accumulator acc [rows, d] and the values
    read from the cache page as they are (``values``: its address; ``element``: one of its elements, whose numba
    type names the format as in `cpu_ffi.widen`; d a multiple of 8)."""
    def codegen(context, b, sig, args):
        values, _, d, page, scores, stats, acc, qpos, lo, base, rows = args
        alpha = _softmax(b, scores, stats, qpos, lo, base, page)
        _weighted_values_by_row(b, scores, values, element, d, page, alpha, acc, rows)
        return context.get_dummy_value()
    return types.void(types.int64, element, *[types.int64] * 9), codegen
