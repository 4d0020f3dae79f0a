"""The int8-activation quantized matmul on weights interleaved by 16 rows (`interleave`), AVX-512 VNNI: the same
operands, launch, scratch and input quantization as `cpu_int8_kernel`'s lane paths, a different inner loop.

A chunk is one 16-row group. Its inputs go through in passes of up to MAX_INPUTS, each input's 16 accumulators
(a register: a lane a weight row) kept in registers over the whole row: per 32-value block, the block's weight
words are loaded (and, 4-bit, unpacked) once for the pass, and each input's 8 words, broadcast, meet them by
``vpdpbusd``: the 16 rows' exact int32 block sums. 8-bit weights are stored plus 128 (unsigned), so the sums start
at ``-128 * (the input's block sum)``.

The arithmetic, per output (input t, row r), is `cpu_amx_kernel`'s: ``acc = fma(float(sum_b), w_scale * x_d,
acc)`` block after block, then, for formats with an offset, ``acc = fma(offset_term, x_s, acc)`` (the block's
``-8 * scale`` for symmetric 4-bit, its offset for affine groups). Every step size and pass runs it, so a row's
result is bit-identical whatever shares its step (batch invariance). The lane paths sum 4 products a lane and
scale lanes: their results differ from this path's by float32 rounding (both are tested against the float64
product)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from pallas_kernels.cpu_ffi import drop_stale_cache

drop_stale_cache(__file__)

from pallas_kernels.cpu_ffi import (  # noqa: E402 (after the stale-cache check)
    ir_fma16,
    ir_for,
    ir_prefetch,
    load64,
    stable_key,
)
from pallas_kernels.quantized_matmul.cpu_int8_kernel import (  # noqa: E402
    AFFINE,
    G32,
    KINDS,
    NEG8,
    ROWS_PER_CHUNK,
    _c,
    _fn,
    _load,
    _ptr,
    _splat,
    chunk_setup,
)
from pallas_kernels.quantized_matmul.interleave import ROWS  # noqa: E402

_F32, _HALF = ir.FloatType(), ir.HalfType()
_I32 = ir.IntType(32)
_V = ir.VectorType(_F32, 16)
_VI = ir.VectorType(_I32, 16)

MAX_INPUTS = 8  # inputs a pass: 8 weight words, 8 accumulators and their sums fit AVX-512's 32 registers
assert ROWS_PER_CHUNK == ROWS


def _emit_pass(b, bits, half, off_mode, m, args):
    """Inputs 0..m-1 of the pass against the chunk's 16 rows, every block: y row j (16 floats) = input j's
    outputs."""
    data, scale, offset, xq, n, xd, xs, sums, x_stride, blocks, y, y_stride, ahead = args
    size = 2 if half else 4
    words = 4 if bits == 4 else 8  # 64-byte loads a block of the group
    dot = _fn(b, "llvm.x86.avx512.vpdpbusd.512", _VI, [_VI, _VI, _VI])
    zero_i = ir.Constant(_VI, [0] * 16)

    def floats(base, blk):
        at = b.add(base, b.mul(blk, _c(16 * size)))
        if half:
            return b.fpext(_load(b, at, ir.VectorType(_HALF, 16), None, align=2), _V)
        return _load(b, at, _V, None, align=4)

    def body(blk, accs):
        w_at = b.add(data, b.mul(blk, _c(64 * words)))
        with b.if_then(b.icmp_signed("!=", ahead, _c(0))):  # a first pass: the next group's block, into L2
            nxt = b.add(ahead, b.mul(blk, _c(64 * words)))
            for line in range(words):
                ir_prefetch(b, b.add(nxt, _c(64 * line)), 2)
        if bits == 4:
            nibble = ir.Constant(_VI, [0x0F0F0F0F] * 16)
            raw = [_load(b, w_at, _VI, 64 * i, align=64) for i in range(4)]
            w = [b.and_(v, nibble) for v in raw] + [b.and_(b.lshr(v, ir.Constant(_VI, [4] * 16)), nibble)
                                                    for v in raw]
        else:
            w = [_load(b, w_at, _VI, 64 * i, align=64) for i in range(8)]
        ws = floats(scale, blk)
        wo = None
        if off_mode == AFFINE:
            wo = floats(offset, blk)
        elif off_mode == NEG8:
            wo = b.fmul(ws, ir.Constant(_V, [-8.0] * 16))
        out = []
        for j in range(m):
            x_at = b.add(b.add(xq, b.mul(_c(j), n)), b.mul(blk, _c(32)))
            at = b.add(b.mul(_c(j), x_stride), b.mul(blk, _c(4)))
            chains = [zero_i] * (4 if m == 1 else 2)  # independent sums: integers, exact in any order
            if bits == 8:  # weights plus 128: start at -128 * the input's block sum (the quantizing pass's)
                total = _load(b, sums, _I32, at, align=4)
                chains[0] = _splat(b, b.mul(total, ir.Constant(_I32, -128)), _VI)
            for g in range(8):
                xw = _splat(b, _load(b, x_at, _I32, 4 * g, align=4), _VI)
                c = g % len(chains)
                chains[c] = b.call(dot, [chains[c], w[g], xw])
            total = chains[0]
            for c in chains[1:]:
                total = b.add(total, c)
            d = _splat(b, _load(b, xd, _F32, at, align=4), _V)
            acc = ir_fma16(b, b.sitofp(total, _V), b.fmul(ws, d), accs[j])
            if wo is not None:
                acc = ir_fma16(b, wo, _splat(b, _load(b, xs, _F32, at, align=4), _V), acc)
            out.append(acc)
        return out

    accs = ir_for(b, blocks, [ir.Constant(_V, [0.0] * 16)] * m, body)
    for j in range(m):
        b.store(accs[j], _ptr(b, b.add(y, b.mul(_c(j), y_stride)), _V), align=4)


def _passes(bits, half):
    """``passes(variant, data, scale, offset, xq, n, xd, xs, sums, x_stride, blocks, y, y_stride, ahead)``: variant =
    kind * MAX_INPUTS + m - 1 (m inputs); kinds without 32-value groups are never interleaved (no case)."""
    kinds = KINDS[bits]

    @intrinsic
    def passes(typingctx, variant, data, scale, offset, xq, n, xd, xs, sums, x_stride, blocks, y, y_stride, ahead):
        def codegen(context, b, sig, args):
            done = b.append_basic_block("x16_done")
            switch = b.switch(args[0], done)
            for kind, (scale_mode, off_mode) in enumerate(kinds):
                if scale_mode != G32:
                    continue
                for m in range(1, MAX_INPUTS + 1):
                    block = b.append_basic_block(f"x16_{kind}_{m}")
                    switch.add_case(kind * MAX_INPUTS + m - 1, block)
                    b.position_at_end(block)
                    _emit_pass(b, bits, half, off_mode, m, args[1:])
                    b.branch(done)
            b.position_at_end(done)
            return context.get_dummy_value()
        return types.void(*[types.int64] * 14), codegen
    return stable_key(passes, __name__, "passes", bits, half, MAX_INPUTS)


def chunk_fn(bits: int, half: bool, grouped: bool = False):
    """The loop over one 16-row group's passes (`cpu_int8_kernel._chunk`'s contract, the same launch words; the
    launch and handler are `cpu_int8_kernel`'s). Experts' stacks are never interleaved (no grouped loops)."""
    if grouped:
        raise ValueError("experts' weights are not interleaved")
    passes = _passes(bits, half)
    size = 2 if half else 4

    def chunk(words, c):
        (xq, xd, xs, data, scale, offset, y, t, n, o, p, groups, offset_groups, r0, r1, group, mode,
         kind) = chunk_setup(words, c, bits, size, False)
        blocks = n // 32
        sums = load64(words + 112)  # the inputs' exact block sums [t, blocks] int32 (the handler's launch words)
        data, scale, offset = data + r0 * p, scale + r0 * groups * size, offset + r0 * offset_groups * size
        # the first pass hints the next group's blocks into L2 as it reads its own (the passes after it find the
        # group in cache): without it a step of a few inputs ran the memory reads and the arithmetic one after the
        # other (docs/performance.md, "Prefetching for every step size")
        ahead = data + ROWS * p if r1 + ROWS <= o else 0
        t0 = 0
        while t0 < t:
            m = min(MAX_INPUTS, t - t0)
            passes(kind * MAX_INPUTS + m - 1, data, scale, offset, xq + t0 * n, n, xd + 4 * t0 * blocks,
                   xs + 4 * t0 * blocks, sums + 4 * t0 * blocks, 4 * blocks, blocks, y + 4 * (t0 * o + r0), 4 * o,
                   ahead if t0 == 0 else 0)
            t0 += m
    return chunk
