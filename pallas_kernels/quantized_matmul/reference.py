"""The jnp reference: dequantize, then XLA's dot. What GPU and TPU run (XLA fuses the int8/int4 conversion and the
scaling into the dot's operand), what the CPU kernel is checked against, and, in row tiles, the CPU path for
steps with many rows (prefill): each tile is dequantized into float32 and multiplied before the next, so the
whole float matrix never exists."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import dot_precision, take_layer
from pallas_kernels.expert_matmul import expert_matmul
from pallas_kernels.quantized_matmul.format import GROUP_4BIT, QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.interleave import ROWS, deinterleave_jnp, take_rows_jnp


def unpack(data: jax.Array, fmt: QuantFormat) -> jax.Array:
    """data -> the integer values [..., out, in] (uint4 or int8), in input order."""
    if fmt.bits == 8:
        return data
    *lead, out, packed = data.shape
    u = jax.lax.bitcast_convert_type(data, jnp.uint4)  # [..., out, in // 2, 2]: byte j -> (value j, value j + 16)
    u = u.reshape(*lead, out, packed // (GROUP_4BIT // 2), GROUP_4BIT // 2, 2)
    return jnp.swapaxes(u, -1, -2).reshape(*lead, out, 2 * packed)


def dequantize(w: QuantizedWeight, fmt: QuantFormat, dtype=jnp.float32) -> jax.Array:
    """-> [..., out, in] of `dtype`, computed in float32 as ``q * scale + offset`` (interleaved arrays put back in
    row order first)."""
    if fmt.interleaved:
        w = deinterleave_jnp(w, fmt)
    q = unpack(w.data, fmt)
    *lead, out, n = q.shape
    groups = w.scale.shape[-1]
    q = q.astype(jnp.float32).reshape(*lead, out, groups, n // groups)
    if fmt.bits == 4 and w.offset is None:
        q = q - 8.0  # symmetric 4-bit: centred on 8
    v = q * w.scale.astype(jnp.float32)[..., None]
    if w.offset is not None:
        v = v + w.offset.astype(jnp.float32)[..., None]
    return v.reshape(*lead, out, n).astype(dtype)


def take_rows(w: QuantizedWeight, fmt: QuantFormat, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` of W, dequantized: an embedding lookup. ids [...] -> [..., in]."""
    if fmt.interleaved:
        return dequantize(take_rows_jnp(w, fmt, ids), dataclasses.replace(fmt, interleaved=False), dtype)
    rows = QuantizedWeight(*(None if a is None else jnp.take(a, ids, axis=0) for a in w))
    return dequantize(rows, fmt, dtype)


def layer_of(w: QuantizedWeight, layer: jax.Array | None) -> QuantizedWeight:
    if layer is None:
        return w
    return QuantizedWeight(*(None if a is None else take_layer(a, layer) for a in w))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=dot_precision(x))


def matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ dequantize(w)[out, in]^T -> [..., out] (x's dtype); with `layer`, w's arrays are stacks
    [layers, ...] and layer `layer` is used. Per-channel symmetric int8 multiplies by the int8 weights and scales
    the output; other formats dequantize the weight into x's dtype."""
    w = layer_of(w, layer)
    if fmt.group == 0 and w.offset is None:
        return (_dot(x, w.data.astype(x.dtype)) * w.scale[..., 0].astype(x.dtype)).astype(x.dtype)
    return _dot(x, dequantize(w, fmt, x.dtype))


def grouped_matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, experts: jax.Array,
                   layer: jax.Array | None = None) -> jax.Array:
    """A mixture of experts' projection: each row of x [R, in] by its expert's (`experts` [R], any order)
    dequantize(w)[expert, out, in]^T -> [R, out] (x's dtype); w's arrays [experts, out, ...], or with `layer`
    stacks [layers, experts, out, ...]. The experts dequantized in the step, then `expert_matmul` (XLA fuses the
    conversion on GPU and TPU)."""
    return expert_matmul(x, dequantize(layer_of(w, layer), fmt, x.dtype), experts).astype(x.dtype)


def row_tiles(out_features: int, max_tile: int = 512) -> int:
    """How many equal row tiles of at most about max_tile rows split `out_features`."""
    n = -(-out_features // max_tile)
    while out_features % n:
        n += 1
    return n


def tiled_matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, layer: jax.Array | None = None,
                 max_tile: int = 512) -> jax.Array:
    """`matmul` one tile of weight rows at a time (a loop in the step), dequantizing only that tile."""
    stacked = layer is not None
    out = w.data.shape[-2]
    # an interleaved weight is cut between its 16-row groups: each tile is an interleaved weight of its own
    tiles = row_tiles(out // ROWS, max(1, max_tile // ROWS)) if fmt.interleaved else row_tiles(out, max_tile)
    if tiles == 1:
        return matmul(x, w, fmt, layer)
    rows = out // tiles
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def tile(i):
        def part(a):
            if a is None:
                return None
            a = a if stacked else a[None]
            return jax.lax.dynamic_slice(a, (index, i * rows, 0), (1, rows, a.shape[-1]))[0]
        return _dot(x, dequantize(QuantizedWeight(*map(part, w)), fmt, x.dtype))  # [..., rows]

    y = jax.lax.map(tile, jnp.arange(tiles, dtype=jnp.int32))  # [tiles, ..., rows]
    return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], out)
