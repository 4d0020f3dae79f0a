"""Activations quantized to int8 in blocks of 32 values, as llama.cpp's Q8_1 blocks: what the int8 kernel
multiplies the weights' integers by.

A block's values ``x`` become ``q = round(x / d)`` in [-127, 127] with ``d = max|x| / 127`` (computed as
``max|x| * float32(1 / 127)``), and the block keeps ``d`` and ``d * sum(q)`` (the latter multiplies a weight
group's offset: ``sum((w_q * s + m) * q * d) = s * d * sum(w_q * q) + m * (d * sum(q))``). The kernel quantizes its
inputs itself, exactly as `quantize` does (its tests compare them bit for bit); elementwise per row, so a row's
blocks do not depend on the other rows of the step (batch invariance).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
INV_127 = np.float32(1 / 127)  # d = max|x| * INV_127, in the kernel as here


class Int8Activations(NamedTuple):
    q: jax.Array  # int8 [T, n]
    d: jax.Array  # float32 [T, n // 32]: the block's step
    s: jax.Array  # float32 [T, n // 32]: d * sum(q) over the block


def quantize(x: jax.Array) -> Int8Activations:
    """x float32 [T, n] (n a multiple of 32) -> its int8 blocks."""
    t, n = x.shape
    blocks = x.reshape(t, n // BLOCK, BLOCK)
    d = jnp.max(jnp.abs(blocks), axis=-1) * INV_127  # a product, not a division XLA may or may not rewrite
    inv = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    q = jnp.clip(jnp.round(blocks * inv[..., None]), -127, 127).astype(jnp.int8)
    s = d * jnp.sum(q.astype(jnp.int32), axis=-1).astype(jnp.float32)
    return Int8Activations(q.reshape(t, n), d, s)


def dequantize(a: Int8Activations) -> np.ndarray:
    """The float32 values the blocks stand for, [T, n] (numpy: for tests and error reports)."""
    q = np.asarray(a.q, np.float32)
    t, n = q.shape
    return (q.reshape(t, n // BLOCK, BLOCK) * np.asarray(a.d)[..., None]).reshape(t, n)
