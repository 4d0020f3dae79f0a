"""Weights interleaved by 16 rows: the layout the CPU int8 kernel's ``x16`` loops read (`cpu_x16_kernel`).

A plain quantized weight (`format`) stores row after row, so one 64-byte load holds 64 values of a single row: the
integer dot products then sum within a row, and every pair of blocks needs its own conversion and scaling per row
and input. Interleaved, each group of 16 rows stores, block after block (32 values), the block's 4-value words
row beside row: word w of the 16 rows is one 64-byte load, a lane a row. One ``vpdpbusd`` against the input's word
w (broadcast) then advances 16 rows at once, a block's 8 words give the 16 rows' exact int32 block sums, and one
conversion and one fused multiply-add scale all 16 (the scales are interleaved alike: 16 rows' scales of a block
are one load). The unpacked weights meet every input of a pass from registers.

For ``W [..., out, in]`` (``out`` a multiple of 16, 32-value groups), the arrays keep their shapes; their contents:
- ``data``: per 16-row group, per 32-value block, the block's words w (4 bytes: values 4w..4w+3 of 8-bit data;
  for 4-bit data the byte pairs values j and j + 16 as GGUF packs them, so word w holds 4w..4w+3 and 16 + 4w..)
  as ``[words, 16 rows, 4 bytes]``; 8-bit values are stored plus 128 (as unsigned bytes in the int8 array: the
  dot product's unsigned operand);
- ``scale`` and ``offset``: per 16-row group, ``[groups, 16 rows]``.
`interleave` and `deinterleave` convert (numpy); `deinterleave_jnp` is the same inverse in a step (what the
reference reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight

ROWS = 16
BLOCK = 32


def supports(fmt: QuantFormat | None, out_features: int) -> bool:
    """Whether a weight of `fmt` with `out_features` rows can be interleaved: 32-value groups (4-bit, GGUF Q8_0
    and Q5_K-like 8-bit) and whole 16-row groups."""
    return fmt is not None and fmt.group == BLOCK and out_features % ROWS == 0 and out_features > 0


def _words(fmt: QuantFormat) -> int:
    return 4 if fmt.bits == 4 else 8  # 4-byte words a row's block takes


def _data(data, fmt: QuantFormat, xp, forward: bool):
    *lead, out, packed = data.shape
    w = _words(fmt)
    blocks = packed // (4 * w)
    if forward:
        v = data.reshape(*lead, out // ROWS, ROWS, blocks, w, 4)
        v = xp.moveaxis(v, -4, -2)  # [..., groups, blocks, words, rows, 4]
    else:
        v = data.reshape(*lead, out // ROWS, blocks, w, ROWS, 4)
        v = xp.moveaxis(v, -2, -4)  # [..., groups, rows, blocks, words, 4]
    v = v.reshape(*lead, out, packed)
    if fmt.bits == 8:  # stored plus 128: the same bits as a xor of the sign bit
        v = (v.view(np.uint8) ^ np.uint8(0x80)).view(np.int8) if xp is np else \
            jnp.bitwise_xor(v, jnp.int8(-128))
    return v


def _rows(a, xp, forward: bool):
    *lead, out, groups = a.shape
    if forward:
        v = xp.swapaxes(a.reshape(*lead, out // ROWS, ROWS, groups), -1, -2)
    else:
        v = xp.swapaxes(a.reshape(*lead, out // ROWS, groups, ROWS), -1, -2)
    return v.reshape(*lead, out, groups)


def interleave(w: QuantizedWeight, fmt: QuantFormat) -> QuantizedWeight:
    """A plain weight's numpy arrays -> interleaved (see the module's docstring)."""
    if not supports(fmt, w.data.shape[-2]):
        raise ValueError(f"{fmt.label} weights of {w.data.shape[-2]} rows cannot be interleaved by {ROWS}")
    return QuantizedWeight(np.ascontiguousarray(_data(np.asarray(w.data), fmt, np, True)),
                           *(None if a is None else np.ascontiguousarray(_rows(np.asarray(a), np, True))
                             for a in (w.scale, w.offset)))


def deinterleave(w: QuantizedWeight, fmt: QuantFormat) -> QuantizedWeight:
    """The inverse of `interleave` (numpy)."""
    return QuantizedWeight(np.ascontiguousarray(_data(np.asarray(w.data), fmt, np, False)),
                           *(None if a is None else np.ascontiguousarray(_rows(np.asarray(a), np, False))
                             for a in (w.scale, w.offset)))


def deinterleave_jnp(w: QuantizedWeight, fmt: QuantFormat) -> QuantizedWeight:
    """The inverse of `interleave` in a step (jax arrays)."""
    return QuantizedWeight(_data(w.data, fmt, jnp, False),
                           *(None if a is None else _rows(a, jnp, False) for a in (w.scale, w.offset)))


def take_rows_jnp(w: QuantizedWeight, fmt: QuantFormat, ids: jax.Array) -> QuantizedWeight:
    """Rows `ids` [...] of an interleaved weight (no leading axes), in row order: [..., packed] and [..., groups]
    arrays of the plain layout (an embedding lookup in a tied table)."""
    out, packed = w.data.shape
    w_ = _words(fmt)
    group, lane = ids // ROWS, ids % ROWS
    data = w.data.reshape(out // ROWS, packed // (4 * w_), w_, ROWS, 4)[group, :, :, lane, :]  # [..., blocks, w, 4]
    data = data.reshape(*ids.shape, packed)
    if fmt.bits == 8:
        data = jnp.bitwise_xor(data, jnp.int8(-128))

    def rows(a):
        return None if a is None else a.reshape(out // ROWS, a.shape[-1], ROWS)[group, :, lane]
    return QuantizedWeight(data, rows(w.scale), rows(w.offset))
