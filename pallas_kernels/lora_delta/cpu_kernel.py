"""The CPU adapter-term kernel: two passes over XLA's thread pool, each reading the tables in place (no gathered
copies). First ``u[t] = A[layer, s_t] x[t]`` by blocks of A's rows (every token of the step against the rows of its
own slot: tokens that share an adapter read its rows from cache); then, by runs of output columns,
``y[t, o] = sum_r u[t, part(o) R + r] B[layer, s_t, r, o]`` with B stored transposed ([R, out]) (`b_rows`), every
rank of 64 outputs at a time in registers (`expand`: 4 independent chains of 16-output FMAs over the ranks),
gate/up's alternating outputs taking each rank's two coefficients lane by lane. A step of a few tokens (a decode
step, whose tables come from memory) hints the rows each pass reads next while it reads these (`hint`; the second
pass every rank's row HINT_AHEAD outputs ahead: R streams the hardware prefetchers do not follow). In a step of at
least GROUP tokens both passes take a slot's tokens GROUP at a time, each table vector widened once for the group
(about twice the multiply-adds a second of token by token). Each output sums its rank terms from zero, ranks in
order, one fma each, and each dot is one fixed chain, so a token's result does not depend on the path, on the
grouping, on the others or on the thread split. A token without an adapter gets exact zeros.
Tables hold float32, float16 or bfloat16 values (the engine's `lora_dtype`); 16-bit values are widened to float32
as they are read (`pallas_kernels.cpu_ffi.widen`): a decode step streams its adapters' tables, half the bytes."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

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
    ir_for,
    ir_hsum,
    ir_prefetch,
    is_execute,
    launch,
    load32,
    load64,
    prefetch,
    symbol,
    to_int,
    to_ptr,
    widen,
    workers,
)

_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
ROWS_PER_CHUNK = 16  # the first pass's rows of A per chunk
COLS_PER_CHUNK = 64  # the unit of the second pass's chunks (a head_dim of q/k/v's parts: a run is never cut)
SERIAL_MACS = 1 << 16  # a pass of at most so many multiply-adds runs on the calling thread alone
STREAMED_TOKENS = 4  # a step of at most so many tokens reads its tables from memory: its passes hint them ahead
ALTERNATING_COLS = 512  # the second pass's chunk unit where outputs alternate parts (gate/up)
GROUP = 4  # tokens of one slot a pass takes at once: each table vector widened once for them all
TOKENS_PER_CHUNK = 16  # the first pass's chunks: so many tokens x ROWS_PER_CHUNK of A's rows (a prefill's tokens
# spread over the threads even where A has a single block of rows)


_F32, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VEC = 16  # outputs a vector FMA of the second pass
_CHAINS = 4  # independent accumulators of the second pass's rank sums (an FMA's latency over its throughput)


def _widened(b, addr, element, count):
    """`count` table elements at addr as <count x float> (`cpu_ffi.widen`'s conversions)."""
    if element == types.float32:
        return b.load(b.inttoptr(addr, ir.VectorType(_F32, count).as_pointer()), align=4)
    bits = b.load(b.inttoptr(addr, ir.VectorType(_I16, count).as_pointer()), align=2)
    if element == types.uint16:  # float16
        return b.fpext(b.bitcast(bits, ir.VectorType(ir.HalfType(), count)), ir.VectorType(_F32, count))
    wide = b.shl(b.zext(bits, ir.VectorType(_I32, count)), ir.Constant(ir.VectorType(_I32, count), [16] * count))
    return b.bitcast(wide, ir.VectorType(_F32, count))  # bfloat16: the upper half of a float32


def _addresses(b, at, count):
    """The `count` int64 words at address `at` (a group's token addresses, stored by the caller)."""
    return [b.load(b.inttoptr(b.add(at, ir.Constant(_I64, 8 * i)), _I64.as_pointer()), align=8)
            for i in range(count)]


def _expand(b, ys, src, stride, c0s, c1s, rank, n, element, alternating, ahead=0):
    """ys[k][i] = sum over ranks r in order, from zero, of fma(c_r(k, i), widen(src[r * stride + i]), .) for i < n,
    each token k of a group, the rank sums of _VEC x _CHAINS outputs of every token in registers (independent FMA
    chains; each B vector widened once for the group), then _VEC, then one at a time: c_r(k, i) is the float at
    c0s[k] + 4 r or, alternating (outputs of parts 0 and 1 in turn, i = 0 a part-0 output), at c1s[k] + 4 r for
    odd i. Each (token, output) chain is the same whatever the group. ahead: each step of _VEC x _CHAINS outputs
    first hints every rank's row so many outputs further on into cache (a decode step's tables, from memory: R
    streams the hardware prefetchers do not follow)."""
    size = 2 if element in (types.uint16, types.int16) else 4

    def run(count, chains, start):
        vf, vi = ir.VectorType(_F32, count), ir.VectorType(_I32, count)
        fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{count}f32")

        def splat(addr):
            v = b.insert_element(ir.Constant(vf, None), b.load(b.inttoptr(addr, _F32.as_pointer()), align=4),
                                 ir.Constant(_I32, 0))
            return b.shuffle_vector(v, ir.Constant(vf, None), ir.Constant(vi, [0] * count))

        def body(i, _):
            at = b.add(start, b.mul(i, ir.Constant(_I64, count * chains)))
            if ahead and chains == _CHAINS:
                def hint_rank(r, _):
                    row = b.add(src, b.mul(b.add(b.add(b.mul(r, stride), at), ir.Constant(_I64, ahead)),
                                           ir.Constant(_I64, size)))
                    for line in range(count * chains * size // 64):
                        ir_prefetch(b, b.add(row, ir.Constant(_I64, 64 * line)), 3)
                    return []
                ir_for(b, rank, [], hint_rank)
            if count == 1:
                odd = b.trunc(b.and_(at, ir.Constant(_I64, 1)), ir.IntType(1))
                odd = b.insert_element(ir.Constant(ir.VectorType(ir.IntType(1), 1), None), odd, ir.Constant(_I32, 0))
            else:  # `at` is a multiple of _VEC: lane j's parity is j's
                odd = ir.Constant(ir.VectorType(ir.IntType(1), count), [j % 2 for j in range(count)])

            def rank_step(r, accs):
                row = b.add(b.mul(r, stride), at)
                ws = [_widened(b, b.add(src, b.mul(b.add(row, ir.Constant(_I64, count * j)), ir.Constant(_I64, size))),
                               element, count) for j in range(chains)]
                new = []
                for k in range(len(ys)):
                    c = splat(b.add(c0s[k], b.mul(r, ir.Constant(_I64, 4))))
                    if alternating:
                        c = b.select(odd, splat(b.add(c1s[k], b.mul(r, ir.Constant(_I64, 4)))), c)
                    new += [b.call(fma, [c, w, accs[k * chains + j]]) for j, w in enumerate(ws)]
                return new
            accs = ir_for(b, rank, [ir.Constant(vf, [0.0] * count)] * (chains * len(ys)), rank_step)
            for k, y in enumerate(ys):
                for j in range(chains):
                    at_j = b.add(at, ir.Constant(_I64, count * j))
                    b.store(accs[k * chains + j], b.inttoptr(b.add(y, b.mul(at_j, ir.Constant(_I64, 4))),
                                                             vf.as_pointer()), align=4)
            return []
        return body

    done = ir.Constant(_I64, 0)
    for count, chains in ((_VEC, _CHAINS), (_VEC, 1), (1, 1)):
        steps = b.sdiv(b.sub(n, done), ir.Constant(_I64, count * chains))
        ir_for(b, steps, [], run(count, chains, done))
        done = b.add(done, b.mul(steps, ir.Constant(_I64, count * chains)))


def _expand_intrinsic(alternating, ahead=0):
    @intrinsic
    def expand(typingctx, y, src, stride, c0, c1, rank, n, element):
        """y[0:n] (float32 address) = the rank terms of src (B rows of `element`'s type from address src, `stride`
        elements apart) and the coefficients at c0 (and c1: `_expand`), summed in registers."""
        def codegen(context, b, sig, args):
            y, src, stride, c0, c1, rank, n = args[:7]
            _expand(b, [y], src, stride, [c0], [c1], rank, n, sig.args[7], alternating, ahead)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 7, element), codegen
    return expand


def _expand_group_intrinsic(alternating):
    @intrinsic
    def expand_group(typingctx, ys, y_offset, src, stride, cs, c_offset, rank, n, element):
        """`expand` for a group of GROUP tokens of one slot: token k's outputs from y_offset bytes past the address
        ys[k], its coefficients from c_offset bytes past cs[k] (alternating: part 1's R floats after part 0's)."""
        def codegen(context, b, sig, args):
            ys, y_offset, src, stride, cs, c_offset, rank, n = args[:8]
            c0s = [b.add(c, c_offset) for c in _addresses(b, cs, GROUP)]
            c1s = [b.add(c, b.mul(rank, ir.Constant(_I64, 4))) for c in c0s]
            _expand(b, [b.add(y, y_offset) for y in _addresses(b, ys, GROUP)], src, stride, c0s, c1s, rank, n,
                    sig.args[8], alternating)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 8, element), codegen
    return expand_group


expand, expand_alternating = _expand_intrinsic(False), _expand_intrinsic(True)
HINT_AHEAD = 2 * _VEC * _CHAINS  # outputs a streamed `expand` hints its rows ahead
expand_hinted, expand_hinted_alternating = _expand_intrinsic(False, HINT_AHEAD), _expand_intrinsic(True, HINT_AHEAD)
expand_group, expand_group_alternating = _expand_group_intrinsic(False), _expand_group_intrinsic(True)


A_ROWS = 4  # rows of A a token's first-pass step meets at once (its input loaded once for them)


def _emit_dots(b, xs, rows_at, n, ys, element, count):
    """ys[k][j] = the fixed-order dot of the float32 input at xs[k] and row j (elements of `element`'s type, rows n
    apart from rows_at) for j < count, each token k of a group: 16-lane FMA chains over n // 16 vectors, a fixed
    tree over the lanes (`ir_hsum`), then the last n % 16 products in order. Each row's vector is widened once for
    every token of the group; each (token, row) chain is the same whatever the group."""
    size = 2 if element in (types.uint16, types.int16) else 4
    v16 = ir.VectorType(_F32, _VEC)
    fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(v16, [v16] * 3), "llvm.fma.v16f32")
    fma1 = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
    tokens = len(xs)

    def row_at(j, at):
        return b.add(rows_at, b.mul(b.add(b.mul(ir.Constant(_I64, j), n), at), ir.Constant(_I64, size)))

    def vec(i, accs):
        at = b.mul(i, ir.Constant(_I64, _VEC))
        rows = [_widened(b, row_at(j, at), element, _VEC) for j in range(count)]
        new = []
        for k, x in enumerate(xs):
            xv = b.load(b.inttoptr(b.add(x, b.mul(at, ir.Constant(_I64, 4))), v16.as_pointer()), align=4)
            new += [b.call(fma, [row, xv, accs[k * count + j]]) for j, row in enumerate(rows)]
        return new

    vectors = b.sdiv(n, ir.Constant(_I64, _VEC))
    accs = ir_for(b, vectors, [ir.Constant(v16, [0.0] * _VEC)] * (count * tokens), vec)
    sums = [ir_hsum(b, acc) for acc in accs]
    done = b.mul(vectors, ir.Constant(_I64, _VEC))

    def tail(i, sums):
        at = b.add(done, i)
        rows = [b.extract_element(_widened(b, row_at(j, at), element, 1), ir.Constant(_I32, 0)) for j in range(count)]
        new = []
        for k, x in enumerate(xs):
            xs_k = b.load(b.inttoptr(b.add(x, b.mul(at, ir.Constant(_I64, 4))), _F32.as_pointer()), align=4)
            new += [b.call(fma1, [row, xs_k, sums[k * count + j]]) for j, row in enumerate(rows)]
        return new
    totals = ir_for(b, b.sub(n, done), sums, tail)
    for k, y in enumerate(ys):
        for j in range(count):
            b.store(totals[k * count + j], b.inttoptr(b.add(y, ir.Constant(_I64, 4 * j)), _F32.as_pointer()), align=4)


def _dots_intrinsic(count, tokens):
    @intrinsic
    def dots(typingctx, x, rows_at, n, y, offset, element):
        """`count` table rows from rows_at against inputs (float32, n values) into outputs (float32, from `offset`
        bytes past y): one token's input at x into y, or for a group (tokens > 1) the addresses at x and y hold
        each token's (`_emit_dots`)."""
        def codegen(context, b, sig, args):
            x, rows_at, n, y, offset = args[:5]
            xs, ys = ([x], [y]) if tokens == 1 else (_addresses(b, x, tokens), _addresses(b, y, tokens))
            _emit_dots(b, xs, rows_at, n, [b.add(y, offset) for y in ys], sig.args[5], count)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 5, element), codegen
    return dots


dots_block, dots_one = _dots_intrinsic(A_ROWS, 1), _dots_intrinsic(1, 1)
dots_group_block, dots_group_one = _dots_intrinsic(A_ROWS, GROUP), _dots_intrinsic(1, GROUP)


@numba.njit(inline="always", **_KW)
def hint(addr, size):
    """Hints the lines of [addr, addr + size) into every cache level. A decode step reads each table once, from
    memory (the weights streamed since evicted it): rows of a few hundred bytes to a few KB, too short for the
    hardware prefetchers to get ahead of, so each pass hints the rows it reads next while it reads these."""
    for line in range(addr & ~np.int64(63), addr + size, 64):
        prefetch(line)


@numba.njit(inline="always", **_KW)
def by_slot(slots, n_slots, t0, t1):
    """(order, count): the tokens of t0:t1 that have an adapter (a slot in 0:n_slots), ordered by slot, each slot's
    in step order (a counting sort: a prefill's thousands of tokens cost a pass each)."""
    starts = np.zeros(n_slots + 1, np.int64)
    for tok in range(t0, t1):
        s = slots[tok]
        if 0 <= s < n_slots:
            starts[s + 1] += 1
    for s in range(n_slots):
        starts[s + 1] += starts[s]
    order = np.empty(starts[n_slots], np.int64)
    for tok in range(t0, t1):
        s = slots[tok]
        if 0 <= s < n_slots:
            order[starts[s]] = tok
            starts[s] += 1
    return order, len(order)


@numba.njit(inline="always", **_KW)
def run_end(slots, order, i, count):
    """The end of the run of order[i:] that shares order[i]'s slot."""
    end = i + 1
    while end < count and slots[order[end]] == slots[order[i]]:
        end += 1
    return end


@numba.njit(inline="always", **_KW)
def first_use(slots, t0, tok):
    """Whether no token of t0:tok uses token tok's slot (its rows not yet read: worth hinting)."""
    for i in range(t0, tok):
        if slots[i] == slots[tok]:
            return False
    return True


@numba.njit(inline="always", **_KW)
def a_rows_of(x, a, s, u, r0, r1, cold, group, xp, up):
    """Rows r0:r1 of slot s's A against one token's input (at xp, into u at up) or a group's (`group`: xp and up
    the addresses of GROUP tokens' addresses), A_ROWS rows at a time, the rows hinted ahead where `cold`."""
    n = x.shape[1]
    row_bytes = n * a.itemsize
    r = r0
    if cold:
        hint(a[s, r].ctypes.data, min(A_ROWS, r1 - r) * row_bytes)
    while r + A_ROWS <= r1:
        if cold and r + A_ROWS < r1:  # the next block's rows, while this one's are read
            hint(a[s, r + A_ROWS].ctypes.data, min(A_ROWS, r1 - r - A_ROWS) * row_bytes)
        if group:
            dots_group_block(xp, a[s, r].ctypes.data, n, up, 4 * r, a[s, r, 0])
        else:
            dots_block(xp, a[s, r].ctypes.data, n, up, 4 * r, a[s, r, 0])
        r += A_ROWS
    while r < r1:
        if group:
            dots_group_one(xp, a[s, r].ctypes.data, n, up, 4 * r, a[s, r, 0])
        else:
            dots_one(xp, a[s, r].ctypes.data, n, up, 4 * r, a[s, r, 0])
        r += 1


@numba.njit(**_KW)
def a_block(x, a, slots, u, t0, t1, r0, r1):
    """u[t0:t1, r0:r1] = x A[s_t]^T by A's rows r0:r1 (no adapter, or a slot past the table: zeros), A_ROWS rows at
    a time, and where t0:t1 holds GROUP tokens or more a slot's tokens GROUP at a time (each row's vectors widened
    once for the group): each (token, row) dot the same fixed-order sum however tokens and rows are grouped
    (`_emit_dots`). A step of at most STREAMED_TOKENS reads its tables from memory: each slot's first token hints
    its rows ahead (a bigger step's rows are shared)."""
    streamed = x.shape[0] <= STREAMED_TOKENS
    for tok in range(t0, t1):
        s = slots[tok]
        if s < 0 or s >= a.shape[0]:
            u[tok, r0:r1] = np.float32(0.0)
        elif t1 - t0 < GROUP:  # (a decode step's: no group, nothing to order)
            cold = streamed and first_use(slots, t0, tok)
            a_rows_of(x, a, s, u, r0, r1, cold, False, x[tok].ctypes.data, u[tok].ctypes.data)
    if t1 - t0 < GROUP:
        return
    order, count = by_slot(slots, a.shape[0], t0, t1)
    xs, us = np.empty(GROUP, np.int64), np.empty(GROUP, np.int64)
    i = 0
    while i < count:
        s = slots[order[i]]
        end = run_end(slots, order, i, count)
        cold = streamed
        while i < end:
            group = end - i >= GROUP
            if group:
                for k in range(GROUP):
                    xs[k], us[k] = x[order[i + k]].ctypes.data, u[order[i + k]].ctypes.data
                a_rows_of(x, a, s, u, r0, r1, cold, True, xs.ctypes.data, us.ctypes.data)
            else:
                a_rows_of(x, a, s, u, r0, r1, cold, False, x[order[i]].ctypes.data, u[order[i]].ctypes.data)
            cold = False  # the slot's rows are in cache now
            i += GROUP if group else 1


@numba.njit(**_KW)
def b_token_rows(b, parts_p, alternating, slots, u, y, o0, o1, streamed=True):
    """y[:, o0:o1], each run of outputs of one part (a row of o or down is one run, q/k/v's a run per head group and
    part) or, for gate/up's alternating outputs, the block whole, by `expand` (`expand_alternating`: each lane's
    coefficient by its parity). streamed: the step's tables come from memory (a decode step's): each slot's first
    token hints its rows ahead (`token_rows`); otherwise a slot's tokens go GROUP at a time where they can
    (`expand_group`: each B vector widened once for the group). Each output sums its rank terms from zero, ranks in
    order, one fma each (a run of mixed parts, each output its own coefficient, in numba's loop)."""
    n_slots, rank = b.shape[0], b.shape[1]
    out = o1 - o0
    whole = alternating and o0 % 2 == 0  # gate, up, ...: lanes by parity (a block from an odd output: listed)
    single = not alternating and parts_p == 0  # one part (o, down): one run
    mixed = alternating and not whole  # one run, each output its own part: summed into y
    listed = 0 if whole or single else out  # outputs whose parts and runs are listed (neither case needs them)
    part = np.zeros(listed, np.int32)
    if mixed:
        for o in range(out):
            part[o] = (o0 + o) % 2
    elif parts_p != 0:
        for o in range(out):
            part[o] = load32(parts_p + 4 * (o0 + o))
    runs = np.empty((max(listed, 1), 3), np.int64)  # (start, length, part; -1: each output its own part)
    n_runs = 0
    if single:
        runs[0, 0], runs[0, 1], runs[0, 2] = 0, out, 0
        n_runs = 1
    elif mixed:
        runs[0, 0], runs[0, 1], runs[0, 2] = 0, out, -1
        n_runs = 1
    elif not whole:
        start = 0
        for o in range(1, out + 1):
            if o == out or part[o] != part[start]:
                runs[n_runs, 0], runs[n_runs, 1], runs[n_runs, 2] = start, o - start, part[start]
                n_runs += 1
                start = o
    stride = b.shape[2]
    grouped = not streamed and not mixed and y.shape[0] >= GROUP
    for tok in range(y.shape[0]):  # (runs in registers store their sums: nothing else to clear)
        s = slots[tok]
        if s < 0 or s >= n_slots or mixed:
            y[tok, o0:o1] = np.float32(0.0)
        if 0 <= s < n_slots and not grouped:  # (a decode step's: no group, nothing to order)
            cold = streamed and first_use(slots, 0, tok)
            token_rows(b, s, u, y[tok, o0:o1], tok, o0, o1, whole, part, runs, n_runs, cold)
    if not grouped:
        return
    order, count = by_slot(slots, n_slots, 0, y.shape[0])
    ys, cs = np.empty(GROUP, np.int64), np.empty(GROUP, np.int64)
    i = 0
    while i < count:
        s = slots[order[i]]
        end = run_end(slots, order, i, count)
        while i < end:
            if end - i >= GROUP:
                for k in range(GROUP):
                    ys[k], cs[k] = y[order[i + k], o0:].ctypes.data, u[order[i + k]].ctypes.data
                src = b[s, 0, o0:].ctypes.data
                if whole:
                    expand_group_alternating(ys.ctypes.data, 0, src, stride, cs.ctypes.data, 0, rank, out, b[s, 0, 0])
                else:
                    for k in range(n_runs):
                        start, n, p = runs[k, 0], runs[k, 1], runs[k, 2]
                        expand_group(ys.ctypes.data, 4 * start, src + b.itemsize * start, stride, cs.ctypes.data,
                                     4 * p * rank, rank, n, b[s, 0, 0])
                i += GROUP
                continue
            token_rows(b, s, u, y[order[i], o0:o1], order[i], o0, o1, whole, part, runs, n_runs, False)
            i += 1


@numba.njit(inline="always", **_KW)
def token_rows(b, s, u, row, tok, o0, o1, whole, part, runs, n_runs, cold):
    """`b_token_rows` for one token (`row` its outputs o0:o1) of slot s; where `cold` (streamed, the slot's first
    token) the rows hinted ahead: the first HINT_AHEAD outputs of every rank's row now, the rest as the runs go."""
    rank, stride, out = b.shape[1], b.shape[2], o1 - o0
    bt = b[s, 0, o0:o1]
    if cold:
        for r in range(rank):
            hint(b[s, r, o0:].ctypes.data, min(out, HINT_AHEAD) * b.itemsize)
    if whole:
        if cold:
            expand_hinted_alternating(row.ctypes.data, bt.ctypes.data, stride, u[tok, :rank].ctypes.data,
                                      u[tok, rank:].ctypes.data, rank, out, bt[0])
        else:
            expand_alternating(row.ctypes.data, bt.ctypes.data, stride, u[tok, :rank].ctypes.data,
                               u[tok, rank:].ctypes.data, rank, out, bt[0])
        return
    mixed = False
    for k in range(n_runs):
        start, n, p = runs[k, 0], runs[k, 1], runs[k, 2]
        if p < 0:
            mixed = True
        elif cold:
            expand_hinted(row.ctypes.data + 4 * start, bt.ctypes.data + bt.itemsize * start, stride,
                          u[tok, p * rank:].ctypes.data, 0, rank, n, bt[0])
        else:
            expand(row.ctypes.data + 4 * start, bt.ctypes.data + bt.itemsize * start, stride,
                   u[tok, p * rank:].ctypes.data, 0, rank, n, bt[0])
    if not mixed:
        return
    for r in range(rank):  # runs of mixed parts: each output its own coefficient, summed into the cleared row
        bt = b[s, r, o0:o1]
        for k in range(n_runs):
            start, n, p = runs[k, 0], runs[k, 1], runs[k, 2]
            if p < 0:
                row_k, bt_k, part_k = row[start:start + n], bt[start:start + n], part[start:start + n]
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


@numba.njit(**_KW)
def b_rows(words, chunk, table_type):
    """The second pass's chunk: a block of outputs for every token (up to STREAMED_TOKENS tokens, the rows hinted
    ahead; past it, a slot's tokens in groups)."""
    _, _, b, parts_p, slots, u, y = _arrays(words, table_type)
    alternating = load64(words + 104) != 0
    per = load64(words + 112)  # outputs a chunk
    o0 = chunk * per
    b_token_rows(b, parts_p, alternating, slots, u, y, o0, min(y.shape[1], o0 + per), y.shape[0] <= STREAMED_TOKENS)


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
def call_words(frame, first, y_p, u_p, itemsize):
    """The launch words (`_views`' order, then the alternating flag and the second pass's outputs a chunk) of a
    call whose operands x, a, b, layer, slots, parts are its inputs first, first + 1, ..., writing the term to y_p
    (its u scratch at u_p), tables of ``itemsize`` bytes: the tables' addresses at the clamped layer."""
    x_p, x_d = buffer(frame, 0)
    a_p, a_d = buffer(frame, first)
    b_p, b_d = buffer(frame, first + 1)
    layer_p, _ = buffer(frame, first + 2)
    slots_p, _ = buffer(frame, first + 3)
    parts_p, parts_d = buffer(frame, first + 4)
    t, n = dim(x_d, 0), dim(x_d, 1)
    s_count, w, rank, o = dim(a_d, 1), dim(a_d, 2), dim(b_d, 2), dim(b_d, 3)
    layer = min(max(np.int64(load32(layer_p)), 0), dim(a_d, 0) - 1)
    a_p += layer * s_count * w * n * itemsize
    b_p += layer * s_count * o * rank * itemsize
    alternating = dim(parts_d, 0) == 2  # (a 2-output layer's own parts would be the same: 0, 1)
    if alternating or dim(parts_d, 0) != o:
        parts_p = 0
    unit = ALTERNATING_COLS if alternating else COLS_PER_CHUNK  # a chunk's outputs: even-aligned runs
    per = unit * (((o + unit - 1) // unit + workers() - 1) // workers())
    return (x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count, np.int64(alternating), per)


@numba.njit(inline="always", **_KW)
def _run(frame, table_type, itemsize, a_chunk, b_chunk):
    """`_execute` for tables of `table_type` (``itemsize`` bytes), its launches' chunks at ``a_chunk`` /
    ``b_chunk``."""
    words = call_words(frame, 1, buffer(frame, 0, True)[0], buffer(frame, 1, True)[0], itemsize)
    x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count, flag, per = words
    alternating = flag != 0
    x, a, b, _, slots, u, y = _views(x_p, a_p, b_p, parts_p, slots_p, u_p, y_p, t, n, w, o, rank, s_count,
                                     table_type)
    if t * w * n <= SERIAL_MACS:  # (a decode step's) on this thread: waking the pool would cost more
        a_block(x, a, slots, u, 0, t, 0, w)
    else:
        token_blocks = (t + TOKENS_PER_CHUNK - 1) // TOKENS_PER_CHUNK
        launch(frame, words, token_blocks * ((w + ROWS_PER_CHUNK - 1) // ROWS_PER_CHUNK), a_chunk, True)
    if t * o * rank <= SERIAL_MACS:
        b_token_rows(b, parts_p, alternating, slots, u, y, 0, o, t <= STREAMED_TOKENS)
    else:
        launch(frame, words, (o + per - 1) // per, b_chunk, True)


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
