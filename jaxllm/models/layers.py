"""Parameter-holding building blocks. Every parameter carries logical axis names (metadata ``axes``) that
`jaxllm.sharding` maps onto a device mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.stacked_layers import LayerSlice

MATMUL_IMPLS = ("auto", "reference", "cpu")


def select_matmul(impl: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``(x [..., in], w [out, in]) -> [..., out]`` (or ``(x, w [layers, out, in], layer) -> x @ w[layer].T``) for
    `impl`: "reference" is XLA's dot; "cpu" is the CPU
    kernel for matmuls of few rows (`pallas_kernels.skinny_matmul.cpu`; it runs XLA's dot itself for more
    rows or other dtypes); "auto" picks "cpu" on the CPU backend."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {impl!r}; choose one of {MATMUL_IMPLS}")
    if impl == "cpu" or (impl == "auto" and jax.default_backend() == "cpu"):
        from pallas_kernels.skinny_matmul.cpu import matmul, register
        register()  # now, not when first traced: a step loaded from the executable cache is never traced
        return matmul
    from pallas_kernels.skinny_matmul.reference import matmul
    return matmul


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
    32 tokens (`benchmarks/offline.py` figures in the README). ``matmul_impl`` (set by the model, see
    `select_matmul`) picks the kernel."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs | None):
        """axes: logical names of (in, out)."""
        self.weight = nnx.Param(_init(rngs, (out_features, in_features), dtype, in_features ** -0.5),  # [out, in]
                                axes=(axes[1], axes[0]))
        self.bias = nnx.Param(_init(rngs, (out_features,), dtype, None), axes=(axes[1],)) if bias else None
        self.matmul_impl = "auto"

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight.get_value()
        if isinstance(w, LayerSlice):  # a layer of a scanned stack: the kernel reads its slice in place
            y = select_matmul(self.matmul_impl)(x, w.stacked, w.index)  # [..., out]
        else:
            y = select_matmul(self.matmul_impl)(x, w)
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
        self.matmul_impl = "auto"

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [..., embed] -> logits [..., vocab] (the embedding is the head's [out, in] weight)."""
        return select_matmul(self.matmul_impl)(x, self.embedding[...])
