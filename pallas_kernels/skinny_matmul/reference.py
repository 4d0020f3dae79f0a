"""The reference skinny matmul: XLA's dot, contracting the weight's last dimension (``[out, in]``, as
checkpoints ship it)."""

from __future__ import annotations

import jax


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in], w [out, in] -> [..., out]."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))
