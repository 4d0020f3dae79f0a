"""Attention kernels for the paged KV cache: a jnp reference (the CPU fast path) and Pallas kernels for TPU
and GPU, all behind one signature."""

import jax
import jax.numpy


def take_layer(stacked: jax.Array, layer: jax.Array | int) -> jax.Array:
    """Layer `layer` of a stack [layers, ...]. A Python int (an unrolled layer loop) is a static slice, which XLA:GPU
    fuses into the consumer's operand (a GEMM reads the layer in place); a traced index (a scan) is a dynamic
    slice."""
    if isinstance(layer, int):
        return stacked[layer]
    return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False)


def dot_precision(x: jax.Array) -> jax.lax.Precision | None:
    """A float32 matmul's precision: HIGHEST (a float32 engine computes in float32; XLA:GPU's default lets cuBLAS
    multiply float32 as TF32, and XLA:TPU as bfloat16 passes); other dtypes: the default."""
    return jax.lax.Precision.HIGHEST if x.dtype == jax.numpy.float32 else None
