"""Parameter-holding building blocks. Every parameter carries logical axis names (metadata ``axes``) that
`jaxllm.sharding` maps onto a device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        std = in_features ** -0.5
        self.kernel = nnx.Param(  # [in, out]
            jax.random.normal(rngs.params(), (in_features, out_features), dtype) * std, axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), axes=(axes[1],)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, axis_name: str | None = None):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf.astype(x.dtype) * self.weight[...]).astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(  # [vocab, embed]
            jax.random.normal(rngs.params(), (vocab, dim), dtype) * 0.02, axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [..., embed] -> logits [..., vocab]."""
        return x @ self.embedding[...].T
