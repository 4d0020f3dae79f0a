"""Parameter-holding building blocks. Every parameter carries logical axis names (metadata ``axes``) that
`jaxllm.sharding` maps onto a device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels import choose_kernels, matmul_kernel
from jaxllm.models.stacked_layers import LayerSlice


def _init(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, std: float | None):
    """Random normal (std) or zeros (std None); with no rngs, only the shape: a loader fills it in."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    if std is None:
        return jnp.zeros(shape, dtype)
    return jax.random.normal(rngs.params(), shape, dtype) * std


class Linear(nnx.Module):
    """y = x W^T + b with W stored [out, in], as checkpoints ship it. XLA:CPU also runs this contraction
    faster than x @ W[in, out] for 16+ rows (decode batches, prefill): 53 vs 66 ms for a SmolLM2 forward of
    32 tokens (`benchmarks/offline.py` figures in the README). ``kernels`` (set by the model: `jaxllm.kernels`)
    picks the matmul kernel; a Linear built on its own uses the current backend's default."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs | None):
        """axes: logical names of (in, out)."""
        self.weight = nnx.Param(_init(rngs, (out_features, in_features), dtype, in_features ** -0.5),  # [out, in]
                                axes=(axes[1], axes[0]))
        self.bias = nnx.Param(_init(rngs, (out_features,), dtype, None), axes=(axes[1],)) if bias else None
        self.kernels = choose_kernels(dtype=dtype)

    @property
    def matmul_impl(self) -> str:
        return self.kernels.matmul

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight.get_value()
        matmul = matmul_kernel(self.kernels)
        if isinstance(w, LayerSlice):  # a layer of a scanned stack: the kernel reads its slice in place
            y = matmul(x, w.stacked, w.index)  # [..., out]
        else:
            y = matmul(x, w)
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        weight = jnp.ones((dim,), dtype) if rngs is not None else jax.ShapeDtypeStruct((dim,), dtype)
        self.weight = nnx.Param(weight, axes=(None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf.astype(x.dtype) * self.weight[...]).astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.embedding = nnx.Param(_init(rngs, (vocab, dim), dtype, 0.02), axes=("vocab", "embed"))  # [vocab, embed]
        self.kernels = choose_kernels(dtype=dtype)

    @property
    def matmul_impl(self) -> str:
        return self.kernels.matmul

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [..., embed] -> logits [..., vocab] (the embedding is the head's [out, in] weight)."""
        return matmul_kernel(self.kernels)(x, self.embedding[...])
