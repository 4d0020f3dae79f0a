"""The reference skinny matmul: XLA's dot, contracting the weight's last dimension (``[out, in]``, as
checkpoints ship it). With `layer`, w is a stack of weights [layers, out, in] and the dot uses w[layer] (a
backend that cannot read the slice in place copies it first)."""

from __future__ import annotations

import jax

from pallas_kernels import dot_precision, take_layer


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in], w [out, in] (or [layers, out, in] with `layer`: [] int32, or an int) -> [..., out]."""
    if layer is not None:
        w = take_layer(w, layer)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=dot_precision(x))
