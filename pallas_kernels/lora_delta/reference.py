"""The adapter term with each token's own slot gathered: x [T, in], a [L, S, P * R, in], b [L, S, R, out] (a layer
stack: layer `layer` is read), slots [T] int32 (-1: no adapter), parts [out] int32 or None: the part of a fused
layer each output row belongs to (its B row multiplies that part's R columns of ``x A^T``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dot_precision


def _take(stack: jax.Array, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """stack[layer, slots] as one gather that reads those slots of that layer alone."""
    flat = stack.reshape(-1, *stack.shape[2:])
    return jnp.take(flat, layer * stack.shape[1] + slots, axis=0)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, layer: jax.Array, slots: jax.Array,
               parts: np.ndarray | None) -> jax.Array:
    p = dot_precision(x)
    rank = b.shape[-2]
    mine = (slots >= 0)[:, None].astype(x.dtype)
    at = jnp.maximum(slots, 0)
    a_t, b_t = _take(a, layer, at), _take(b, layer, at)  # [T, P * R, in], [T, R, out]
    u = jnp.einsum("ti,tri->tr", x, a_t.astype(x.dtype), precision=p) * mine  # [T, P * R]
    if parts is None:
        return jnp.einsum("tr,tro->to", u, b_t.astype(x.dtype), precision=p)
    u_rows = jnp.take(u.reshape(u.shape[0], -1, rank), parts, axis=1)  # [T, out, R]: each row's part's
    return jnp.einsum("tor,tro->to", u_rows, b_t.astype(x.dtype), precision=p)
